"""Token stores: tokenized corpora as chunked zarr v3 arrays, read locally or from a bucket.

A store is a root (a local path or a tensorstore kvstore URL: ``gs://bucket/prefix``,
``s3://...``, ``file:///abs/path``, ``memory://name``) holding, per split::

    <root>/<split>/tokens       zarr v3, 1-D uint8 | uint16 | uint32, chunks of chunk_tokens, zstd
    <root>/<split>/doc_starts   zarr v3, 1-D int64: the first token of every document, [0, ...]
    <root>/meta.json            written last; the store is complete only once it exists

Documents lie back to back; the store inserts no separator (a preparer that wants one appends it
to each document itself). Writing is streaming: ``TokenStoreWriter.append`` takes whole documents
and issues every full chunk's write as soon as it has one, with a few writes in flight at once
(``MAX_WRITES_IN_FLIGHT``), so memory stays a few chunks whatever the corpus size.
``python -m msar_jax.data.token_store convert --src=DIR --dst=ROOT`` turns a prepared ``.bin``
folder into a store. Layout, URLs and the loader: docs/training.md §6.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import tensorstore as ts

FORMAT = "msar-token-store"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
TOKEN_DTYPES = ("uint8", "uint16", "uint32")
DEFAULT_CHUNK_TOKENS = 1 << 20
# doc_starts chunks: 1<<16 int64 = 512 KiB each, so a store of 1e8 documents has ~1500 of them.
DOC_STARTS_CHUNK = 1 << 16
# Chunk cache of a reader: 256 MiB holds 128 uint16 chunks of 1<<20 tokens (2 MiB each).
DEFAULT_CACHE_BYTES = 256 << 20
# Chunk writes a writer keeps in flight per array: 4 uint16 chunks of 1<<20 tokens are 8 MiB held.
# On 2 CPUs the encoding of 4 chunks overlaps the reading of the next (results/prepare_throughput.json).
MAX_WRITES_IN_FLIGHT = 4

# One base context: memory:// stores are shared between the writer and readers of this process
# (a memory kvstore lives in its context); readers add their own bounded chunk cache on top.
_BASE_CONTEXT = ts.Context()


class StoreError(ValueError):
    """A store that is missing, incomplete or does not hold what was asked for."""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# --------------------------------------------------------------------------- #
# paths and specs
# --------------------------------------------------------------------------- #
def kvstore_spec(root: str | Path) -> dict[str, Any]:
    """A local path or a kvstore URL -> tensorstore kvstore spec (JSON), path ending in ``/``.

    ``"/data/store"`` and ``"file:///data/store"`` give the file driver; ``"gs://b/p"`` the gcs
    driver; any other URL tensorstore knows (``memory://``, ``s3://``) passes through unchanged.
    """
    root = str(root)
    if "://" not in root:
        root = "file://" + str(Path(root).expanduser().resolve())
    try:
        spec = ts.KvStore.Spec(root.rstrip("/") + "/").to_json()
    except ValueError as e:
        raise StoreError(f"{root}: not a path or a tensorstore kvstore URL ({e})") from None
    spec["path"] = spec.get("path", "")
    if spec["path"] and not spec["path"].endswith("/"):
        spec["path"] += "/"
    return spec


def _child_spec(root: str | Path, *parts: str) -> dict[str, Any]:
    spec = kvstore_spec(root)
    spec["path"] = spec["path"] + "/".join(parts) + "/"
    return spec


def _root_kvstore(root: str | Path) -> ts.KvStore:
    return ts.KvStore.open(kvstore_spec(root), context=_BASE_CONTEXT).result()


def _zarr_spec(root, split: str, name: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": _child_spec(root, split, name)}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise StoreError(f"split must be one of {list(SPLITS)}, got {split!r}")


# --------------------------------------------------------------------------- #
# writing
# --------------------------------------------------------------------------- #
class _ChunkedAppender:
    """A growing 1-D zarr v3 array written a full chunk at a time, up to ``max_in_flight`` at once.

    Each chunk write is issued without waiting for it (its zstd encoding and file write run on
    tensorstore's threads while the caller reads and hashes the next tokens); the oldest write is
    awaited once ``max_in_flight`` are pending, so at most ``max_in_flight`` chunks plus one partial
    chunk are held. The array's shape grows ahead of the data geometrically (a zarr.json rewrite
    per doubling, issued with no write pending) and ``close`` trims it to the elements written.
    A failed write raises ``StoreError`` at the next ``append`` or at ``close``.
    """

    def __init__(self, spec: dict[str, Any], dtype: np.dtype, chunk: int, where: str,
                 max_in_flight: int = MAX_WRITES_IN_FLIGHT):
        self.dtype, self.chunk, self.where = np.dtype(dtype), int(chunk), where
        self.max_in_flight = int(max_in_flight)
        metadata = {
            "shape": [0],
            "data_type": self.dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [self.chunk]}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                       {"name": "zstd", "configuration": {"level": 3, "checksum": False}}],
            "fill_value": 0,
        }
        self.array = ts.open({**spec, "metadata": metadata}, create=True, delete_existing=True,
                             context=_BASE_CONTEXT).result()
        self.written = 0  # elements issued to the array (a multiple of chunk until close)
        self.capacity = 0  # the array's shape: >= written, trimmed to it by close
        self.in_flight: collections.deque[tuple[int, int, Any]] = collections.deque()
        self.pending: list[np.ndarray] = []
        self.pending_size = 0

    def append(self, values: np.ndarray) -> None:
        if values.size == 0:
            return
        self.pending.append(values)
        self.pending_size += values.size
        if self.pending_size >= self.chunk:
            buf = np.concatenate(self.pending)
            n_full = buf.size // self.chunk * self.chunk
            self._write(buf[:n_full])
            rest = buf[n_full:]
            self.pending, self.pending_size = ([rest] if rest.size else []), rest.size

    def _await(self, lo: int, hi: int, future) -> None:
        try:
            future.result()
        except Exception as e:
            self.abort()
            raise StoreError(f"{self.where}: writing elements [{lo}, {hi}) failed: "
                             f"{_first_line(e)}") from None

    def _write(self, values: np.ndarray) -> None:
        """Issue one write per chunk of ``values`` (whole chunks, or the last partial one)."""
        values = values.astype(self.dtype, copy=False)
        for lo in range(0, values.size, self.chunk):
            part = values[lo:lo + self.chunk]
            start, stop = self.written, self.written + part.size
            if stop > self.capacity:
                self.drain()  # the zarr.json rewrite never races a chunk write
                self.capacity = max(stop, 2 * self.capacity, self.max_in_flight * self.chunk)
                self.array = self.array.resize(exclusive_max=[self.capacity], expand_only=True).result()
            while len(self.in_flight) >= self.max_in_flight:
                self._await(*self.in_flight.popleft())
            self.in_flight.append((start, stop, self.array[start:stop].write(part)))
            self.written = stop
        while self.in_flight and self.in_flight[0][2].done():  # report failures early
            self._await(*self.in_flight.popleft())

    def drain(self) -> None:
        """Wait for every pending write; ``StoreError`` for the first that failed."""
        while self.in_flight:
            self._await(*self.in_flight.popleft())

    def abort(self) -> None:
        """Wait for the pending writes without reporting their errors (the writer failed)."""
        while self.in_flight:
            _, _, future = self.in_flight.popleft()
            try:
                future.result()
            except Exception:
                pass
        self.pending, self.pending_size = [], 0

    def close(self) -> int:
        if self.pending_size:
            self._write(np.concatenate(self.pending))
            self.pending, self.pending_size = [], 0
        self.drain()
        if self.capacity != self.written:
            # Nothing was written past `written` (the out-of-bounds part of the last chunk holds
            # the fill value), so only zarr.json changes: the same files as a write at final size.
            self.array = self.array.resize(exclusive_max=[self.written], shrink_only=True,
                                           resize_metadata_only=True).result()
            self.capacity = self.written
        return self.written


class TokenStoreWriter:
    """Append whole documents to ``<root>/<split>``; ``close()`` flushes the last partial chunk.

    Opening a writer removes ``<root>/meta.json`` first, so a store being rewritten counts as
    incomplete until ``write_meta`` runs again; the split's arrays are replaced.

    Args:
      root: local path or kvstore URL.
      split: ``"train"`` or ``"val"``.
      dtype: token dtype, ``uint8`` / ``uint16`` / ``uint32`` (from the vocabulary size).
      chunk_tokens: tokens per zarr chunk.
      max_in_flight: chunk writes pending at once per array (at least 1; 1 awaits each write);
        the writer holds at most ``max_in_flight + 1`` chunks of tokens.

    A write that fails raises ``StoreError`` (naming the array) at the next ``append`` or at
    ``close``; leaving a ``with`` block by an exception waits for the pending writes and writes
    nothing more, so no ``meta.json`` ever marks a short store complete.
    """

    def __init__(self, root: str | Path, split: str, *, dtype, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                 max_in_flight: int = MAX_WRITES_IN_FLIGHT):
        _check_split(split)
        self.dtype = np.dtype(dtype)
        if self.dtype.name not in TOKEN_DTYPES:
            raise StoreError(f"dtype must be one of {list(TOKEN_DTYPES)}, got {self.dtype.name}")
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) \
                or chunk_tokens <= 0:
            raise StoreError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, (int, np.integer)) \
                or max_in_flight <= 0:
            raise StoreError(f"max_in_flight must be a positive integer, got {max_in_flight!r}")
        self.root, self.split = root, split
        _root_kvstore(root).delete_range(ts.KvStore.KeyRange(META_FILE, META_FILE + "\x00")).result()
        self._tokens = _ChunkedAppender(_zarr_spec(root, split, "tokens"), self.dtype, chunk_tokens,
                                        f"{root}/{split}/tokens", max_in_flight)
        self._starts = _ChunkedAppender(_zarr_spec(root, split, "doc_starts"), np.int64,
                                        DOC_STARTS_CHUNK, f"{root}/{split}/doc_starts", max_in_flight)
        self.num_tokens = 0
        self.num_documents = 0
        self._closed = False

    def append(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` holds them back to back, ``doc_lengths`` their sizes."""
        if self._closed:
            raise StoreError(f"writer for {self.root}/{self.split} is closed")
        tokens = np.asarray(tokens).reshape(-1)
        lengths = np.asarray(doc_lengths, dtype=np.int64).reshape(-1)
        if np.any(lengths <= 0):
            raise StoreError(f"doc_lengths must be positive, got {lengths[lengths <= 0][:3].tolist()}")
        if int(lengths.sum()) != tokens.size:
            raise StoreError(f"sum(doc_lengths) = {int(lengths.sum())} != tokens.size = {tokens.size}")
        if tokens.size and (tokens.dtype.kind not in "ui" or int(tokens.min()) < 0
                            or int(tokens.max()) > np.iinfo(self.dtype).max):
            raise StoreError(f"tokens must be integers in [0, {np.iinfo(self.dtype).max}] for "
                             f"dtype {self.dtype.name}")
        starts = self.num_tokens + np.concatenate([[0], np.cumsum(lengths)[:-1]]) if lengths.size \
            else lengths
        try:
            self._starts.append(starts.astype(np.int64))
            self._tokens.append(tokens)
        except BaseException:  # a failed write (or an interrupt): this writer writes nothing more
            self.abort()
            raise
        self.num_tokens += tokens.size
        self.num_documents += lengths.size

    def close(self) -> dict[str, int]:
        """Write the last partial chunks; returns ``{"tokens": n, "documents": d}``."""
        if not self._closed:
            self._closed = True  # a failed close leaves the writer closed (the store stays incomplete)
            try:
                self._tokens.close()
                self._starts.close()
            except BaseException:
                self.abort()
                raise
        return {"tokens": int(self.num_tokens), "documents": int(self.num_documents)}

    def __enter__(self) -> "TokenStoreWriter":
        return self

    def abort(self) -> None:
        """Wait for the pending writes, report none of their errors, and accept no more."""
        self._closed = True
        self._tokens.abort()
        self._starts.abort()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()


def write_meta(root: str | Path, meta: dict[str, Any]) -> None:
    """Write ``<root>/meta.json`` (one atomic kvstore write); call it after every split is closed.

    ``format`` and ``format_version`` are filled in; ``dtype``, ``tokenizer`` and ``splits``
    (``{split: {"tokens": n, "documents": d}}``) are required.
    """
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, **meta}
    for key in ("dtype", "tokenizer", "splits"):
        if key not in meta:
            raise StoreError(f"store meta for {root} needs the key {key!r}")
    if meta["dtype"] not in TOKEN_DTYPES:
        raise StoreError(f"store meta dtype must be one of {list(TOKEN_DTYPES)}, got {meta['dtype']!r}")
    data = (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    _root_kvstore(root).write(META_FILE, data).result()


# --------------------------------------------------------------------------- #
# reading
# --------------------------------------------------------------------------- #
def read_store_meta(root: str | Path) -> dict[str, Any]:
    """``<root>/meta.json`` as a dict; ``StoreError`` if it is missing (store incomplete)."""
    try:
        raw = _root_kvstore(root).read(META_FILE).result()
    except ValueError as e:
        raise StoreError(f"{root}: cannot read {META_FILE} ({e})") from None
    if raw.state != "value":
        raise StoreError(f"{root}/{META_FILE} not found: not a token store, or an incomplete one "
                         "(meta.json is written last)")
    try:
        meta = json.loads(bytes(raw.value).decode("utf-8"))
    except ValueError as e:
        raise StoreError(f"{root}/{META_FILE} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT:
        raise StoreError(f"{root}/{META_FILE} has format {meta.get('format')!r}, not {FORMAT!r}")
    if meta.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{root}/{META_FILE} has format_version {meta.get('format_version')!r}; "
                         f"this reader knows {FORMAT_VERSION}")
    return meta


def is_store(root: str | Path) -> bool:
    """True when ``root`` holds a complete token store (a ``meta.json`` of this format)."""
    try:
        read_store_meta(root)
    except StoreError:
        return False
    return True


class TokenSplit:
    """One split of a store: ``read(start, stop)`` tokens, ``read_windows`` many at once."""

    def __init__(self, root, split: str, meta: dict[str, Any], cache_bytes: int):
        self.root, self.split, self.meta = root, split, meta
        self.dtype = np.dtype(meta["dtype"])
        info = meta["splits"][split]
        self.num_tokens, self.num_documents = int(info["tokens"]), int(info["documents"])
        self.context = ts.Context({"cache_pool": {"total_bytes_limit": int(cache_bytes)}},
                                  parent=_BASE_CONTEXT)
        try:
            self.tokens = ts.open(_zarr_spec(root, split, "tokens"), open=True,
                                  read=True, context=self.context).result()
        except ValueError as e:
            raise StoreError(f"{root}/{split}/tokens cannot be opened: {e}") from None
        if self.tokens.shape[0] != self.num_tokens or np.dtype(self.tokens.dtype.numpy_dtype) != self.dtype:
            raise StoreError(f"{root}/{split}/tokens holds {self.tokens.shape[0]} "
                             f"{self.tokens.dtype.name} tokens, meta.json says {self.num_tokens} "
                             f"{self.dtype.name}")
        self._doc_starts: np.ndarray | None = None

    @property
    def doc_starts(self) -> np.ndarray:
        """First token of every document (int64, ascending, starts with 0); read on first use."""
        if self._doc_starts is None:
            try:
                arr = ts.open(_zarr_spec(self.root, self.split, "doc_starts"), open=True, read=True,
                              context=self.context).result()
            except ValueError as e:
                raise StoreError(f"{self.root}/{self.split}/doc_starts cannot be opened: {e}") from None
            self._doc_starts = np.asarray(arr.read().result(), dtype=np.int64)
        return self._doc_starts

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` in the stored dtype."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise StoreError(f"{self.root}/{self.split}: read [{start}, {stop}) outside "
                             f"[0, {self.num_tokens})")
        return self.tokens[start:stop].read().result()

    def read_windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """``[len(starts), length]`` tokens: one read per window, all issued before any is awaited."""
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (starts.min() < 0 or starts.max() + length > self.num_tokens):
            raise StoreError(f"{self.root}/{self.split}: a window of {length} tokens leaves "
                             f"[0, {self.num_tokens})")
        futures = [self.tokens[int(s):int(s) + length].read() for s in starts]
        out = np.empty((starts.size, length), dtype=self.dtype)
        for i, f in enumerate(futures):
            out[i] = f.result()
        return out

    def __repr__(self) -> str:
        return (f"TokenSplit({self.root!s}/{self.split}: {self.num_tokens} {self.dtype.name} tokens, "
                f"{self.num_documents} documents)")


def open_split(root: str | Path, split: str, *, cache_bytes: int = DEFAULT_CACHE_BYTES) -> TokenSplit:
    """Open ``<root>/<split>`` of a complete store (``StoreError`` naming the path otherwise).

    ``cache_bytes`` bounds this reader's chunk cache (tensorstore ``cache_pool``).
    """
    _check_split(split)
    meta = read_store_meta(root)
    if split not in meta.get("splits", {}):
        raise StoreError(f"{root} has no split {split!r} (it has {sorted(meta.get('splits', {}))})")
    return TokenSplit(root, split, meta, cache_bytes)


def provenance(root: str | Path, meta: dict[str, Any]) -> dict[str, Any]:
    """What a run trains on when it reads a store, for its ``config.json``."""
    tok = meta["tokenizer"]
    return {
        "store": str(root),
        "format_version": meta["format_version"],
        "tokenizer": tok["kind"],
        "vocab_size": tok["vocab_size"],
        "dtype": meta["dtype"],
        "tokens": {split: int(s["tokens"]) for split, s in meta["splits"].items()},
        "documents": {split: int(s["documents"]) for split, s in meta["splits"].items()},
    }


# --------------------------------------------------------------------------- #
# conversion of prepared .bin folders
# --------------------------------------------------------------------------- #
def separator_doc_starts(tokens: np.ndarray, separator: Sequence[int], block: int = 1 << 24) -> np.ndarray:
    """Document starts of a ``.bin`` split whose documents were joined with ``separator``.

    A document starts at 0 and right after each occurrence of the separator (scanned left to
    right, occurrences do not overlap). For BPE the separator is the single eot id, which never
    occurs inside a document. For bytes it is ``"\\n\\n"``, which prepare's text normalization
    also leaves inside documents (paragraph breaks): there every paragraph counts as a
    document, a finer split than the original documents.
    """
    sep = np.asarray(separator, dtype=np.int64)
    n = tokens.size
    found: list[np.ndarray] = [np.zeros(1, np.int64)]
    if sep.size == 1:
        for lo in range(0, n, block):
            chunk = np.asarray(tokens[lo:lo + block])
            found.append(lo + np.flatnonzero(chunk == sep[0]).astype(np.int64) + 1)
    elif sep.size == 2:
        last_end = -1  # the end of the last accepted separator (to skip overlaps like "\n\n\n")
        for lo in range(0, n - 1, block):
            chunk = np.asarray(tokens[lo:min(n, lo + block + 1)])
            hits = lo + np.flatnonzero((chunk[:-1] == sep[0]) & (chunk[1:] == sep[1]))
            keep = []
            for h in hits.tolist():
                if h >= last_end:
                    keep.append(h + 2)
                    last_end = h + 2
            found.append(np.asarray(keep, dtype=np.int64))
    else:
        raise StoreError(f"separator must be 1 or 2 tokens, got {len(sep)}")
    starts = np.concatenate(found)
    return starts[starts < n]


def bin_separator(meta: dict[str, Any]) -> tuple[int, ...]:
    """The token ids that join documents in a prepared folder (from its ``meta.json``)."""
    tok = meta["tokenizer"]
    if tok["kind"] == "bytes":
        return tuple(str(tok.get("document_separator", "\n\n")).encode("utf-8"))
    if tok.get("eot_id") is None:
        raise StoreError(f"tokenizer {tok['kind']!r} records no eot_id; cannot find documents")
    return (int(tok["eot_id"]),)


def convert_bin_folder(src: str | Path, dst: str | Path, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                       block_tokens: int = 1 << 24) -> dict[str, Any]:
    """Write the store ``dst`` from a prepared folder ``src`` (``train.bin``/``val.bin``).

    Tokens are copied unchanged (separators included); documents start after each separator
    (``separator_doc_starts``). Reads ``block_tokens`` at a time, so memory stays bounded.
    Returns the store's meta.
    """
    from msar_jax.data.prepare import read_meta

    src = Path(src)
    pmeta = read_meta(src)
    dtype = np.dtype(pmeta["dtype"])
    sep = bin_separator(pmeta)
    splits: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        path = src / f"{split}.bin"
        if not path.is_file():
            raise StoreError(f"{path} not found (re-run msar_jax.data.prepare)")
        tokens = np.memmap(path, dtype=dtype, mode="r")
        starts = separator_doc_starts(tokens, sep, block_tokens)
        lengths = np.diff(np.append(starts, tokens.size))
        writer = TokenStoreWriter(dst, split, dtype=dtype, chunk_tokens=chunk_tokens)
        # whole documents per append, about block_tokens at a time
        d = 0
        while d < lengths.size:
            e = int(np.searchsorted(starts, starts[d] + block_tokens, side="left"))
            e = max(e, d + 1)
            hi = int(starts[e]) if e < starts.size else tokens.size
            writer.append(np.asarray(tokens[int(starts[d]):hi]), lengths[d:e])
            d = e
        splits[split] = writer.close()
    meta = {
        "dtype": dtype.name,
        "tokenizer": pmeta["tokenizer"],
        "splits": splits,
        "source": {"kind": "prepared-folder", "path": str(src.resolve()),
                   "source_key": pmeta.get("source_key"), "files": pmeta.get("files")},
        "split_rule": pmeta.get("split", {}).get("rule"),
        "separator_kept": True,
        "doc_starts_rule": (
            "documents start at token 0 and after every separator "
            f"{list(sep)} ({'the eot id' if len(sep) == 1 else 'the bytes of \"\\n\\n\"'}); "
            + ("exact: the eot id occurs only between documents" if len(sep) == 1 else
               "bytes: paragraph breaks inside a document are the same two bytes, so each "
               "paragraph counts as a document")),
    }
    write_meta(dst, meta)
    return {"format": FORMAT, "format_version": FORMAT_VERSION, **meta}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m msar_jax.data.token_store",
                                     description="Token store tools (docs/training.md §6).")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="turn a prepared .bin folder into a token store")
    conv.add_argument("--src", required=True, help="prepared folder (meta.json, train.bin, val.bin)")
    conv.add_argument("--dst", required=True, help="store root: a path or a kvstore URL (gs://...)")
    conv.add_argument("--chunk_tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    info = sub.add_parser("info", help="print a store's splits")
    info.add_argument("root")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            meta = convert_bin_folder(args.src, args.dst, chunk_tokens=args.chunk_tokens)
        else:
            meta = read_store_meta(args.root)
    except (StoreError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = args.dst if args.command == "convert" else args.root
    print(f"{root}: {meta['dtype']} tokens, tokenizer {meta['tokenizer']['kind']} "
          f"(vocab {meta['tokenizer']['vocab_size']})")
    for split, s in meta["splits"].items():
        print(f"  {split}: {s['tokens']} tokens, {s['documents']} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
