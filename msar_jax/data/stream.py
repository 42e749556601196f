"""Streaming, sharded, resumable preparation of large corpora into a token store.

Usage::

    python -m msar_jax.data.stream /data/corpus --out=/data/store --tokenizer=bytes --workers=8
    python -m msar_jax.data.stream 'shards/*.jsonl.zst' more/*.parquet --out=gs://bucket/store \\
        --work_dir=/scratch/parts --tokenizer=bpe --vocab_size=32768 --workers=16

Inputs are folders (every supported file below them), globs or files: ``.txt`` (one document per
file), ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (one document per line, the ``--text_field``
field) and ``.parquet`` (the ``--text_field`` column, read a record batch at a time). Files are
sorted by their path relative to the input that names them, and each worker process takes whole
files; every file's tokens go to a part in the work folder (temp + rename, a manifest written
last), so a killed run restarted with the same command redoes only the unfinished files. The
store (``msar_jax.data.token_store``) is then assembled from the parts in the sorted order, its
``meta.json`` last. Memory is bounded by a batch of documents per worker (``--batch_bytes``) and
one store chunk, whatever the corpus size. Formats, split rule, bad inputs and resuming:
docs/training.md §6, "Preparing large corpora".
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import hashlib
import importlib
import json
import os
import queue
import shutil
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from msar_jax.data import token_store as _store
from msar_jax.data import tokenizers as _tok

_prep = importlib.import_module("msar_jax.data.prepare")  # the package's `prepare` is the function

STREAM_VERSION = 1
SPLITS = ("train", "val")
FORMATS = (".jsonl.zst", ".jsonl.gz", ".jsonl", ".parquet", ".txt")  # longest suffix first
SPLIT_MODULUS = _prep.SPLIT_MODULUS
SPLIT_RULE = (
    "document -> val iff int(hashlib.sha1(doc_id.encode('utf-8')).hexdigest(), 16) % 20 == 0, "
    "else train; doc_id = the file's path relative to its input for .txt, '<path>:<line>' for "
    ".jsonl* (1-based line number), '<path>:<row>' for .parquet (0-based row index)"
)
BYTES_SEPARATOR = b"\n\n"
DEFAULT_BPE_SAMPLE_BYTES = 64 << 20
DEFAULT_BATCH_BYTES = 4 << 20
READ_BLOCK = 1 << 20
TOKENIZER_FILE = "tokenizer.json"
STATE_FILE = "state.json"
# A test hook: exit abruptly (no cleanup, like a kill) once this many parts were written.
STOP_AFTER_PARTS_ENV = "MSAR_STREAM_STOP_AFTER_PARTS"
DATA_EXTRA_HINT = "pip install 'msar-jax[data]'"


class BadInput(ValueError):
    """An input file that cannot be read as documents; the message names the file (and line/row)."""

    def __init__(self, name: str, reason: str, where: str = ""):
        self.name, self.reason, self.where = name, reason, where
        super().__init__(f"{name}{', ' + where if where else ''}: {reason}")

    def __reduce__(self):  # crosses the process boundary from a worker whole
        return (BadInput, (self.name, self.reason, self.where))


class StreamError(ValueError):
    """A user error in the options, the inputs' listing, the work folder or the output."""


def _zstandard():
    try:
        import zstandard
    except ImportError:
        raise ImportError(f"reading .jsonl.zst files needs the zstandard package: {DATA_EXTRA_HINT}") from None
    return zstandard


def _parquet():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ImportError(f"reading .parquet files needs the pyarrow package: {DATA_EXTRA_HINT}") from None
    return pyarrow, pyarrow.parquet


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# --------------------------------------------------------------------------- #
# listing
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class InputFile:
    name: str  # posix path relative to the input that names it: the document id's prefix
    path: str
    fmt: str  # one of FORMATS
    size: int
    mtime_ns: int


def format_of(name: str) -> str | None:
    for suffix in FORMATS:
        if name.endswith(suffix):
            return suffix
    return None


def _glob_base(pattern: str) -> Path:
    """The leading folders of ``pattern`` that hold no glob characters (``data`` of ``data/*/x``)."""
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def list_inputs(specs: Sequence[str]) -> list[InputFile]:
    """Every input file of ``specs`` (folders, globs, files), sorted by relative path.

    The relative path (to the folder given, to a glob's fixed leading folders, or the bare file
    name) is the file's name in document ids, so neither the order nor the ids depend on where the
    corpus lies. Hidden files and folders (a leading ``.``) are left out.
    """
    if not specs:
        raise StreamError("no inputs given: pass folders, globs or files of "
                          ".txt / .jsonl / .jsonl.gz / .jsonl.zst / .parquet")
    found: dict[str, tuple[InputFile, str]] = {}
    for spec in specs:
        p = Path(spec).expanduser()
        pairs: list[tuple[str, Path]] = []
        if glob.has_magic(spec):
            base = _glob_base(str(p))
            for m in glob.glob(str(p), recursive=True):
                mp = Path(m)
                if mp.is_file() and format_of(mp.name):
                    pairs.append((mp.relative_to(base).as_posix(), mp))
        elif p.is_dir():
            for mp in p.rglob("*"):
                rel = mp.relative_to(p)
                if mp.is_file() and format_of(mp.name) and not any(s.startswith(".") for s in rel.parts):
                    pairs.append((rel.as_posix(), mp))
        elif p.is_file():
            if not format_of(p.name):
                raise StreamError(f"input {spec}: not a .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file")
            pairs.append((p.name, p))
        else:
            raise StreamError(f"input {spec}: no such file or folder")
        if not pairs:
            raise StreamError(f"input {spec}: holds no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files")
        for name, mp in pairs:
            if name in found and Path(found[name][0].path) != mp.resolve():
                raise StreamError(f"{name}: named by two inputs ({found[name][1]} and {spec}); "
                                  "document ids (relative path + line/row) must be unique")
            st = mp.stat()
            found[name] = (InputFile(name, str(mp.resolve()), format_of(name), st.st_size, st.st_mtime_ns),
                           spec)
    return [found[k][0] for k in sorted(found)]


# --------------------------------------------------------------------------- #
# reading documents
# --------------------------------------------------------------------------- #
def _raw_chunks(f: InputFile, on_bytes: Callable[[int], None]) -> Iterator[bytes]:
    with open(f.path, "rb") as fh:
        while block := fh.read(READ_BLOCK):
            on_bytes(len(block))
            yield block


def _gzip_chunks(f: InputFile, on_bytes, where: Callable[[], str]) -> Iterator[bytes]:
    """Decompressed blocks of a (multi-member) gzip file; a truncated stream raises ``BadInput``."""
    d = zlib.decompressobj(wbits=31)
    fed = False
    for block in _raw_chunks(f, on_bytes):
        while block:
            fed = True
            try:
                out = d.decompress(block)
            except zlib.error as e:
                raise BadInput(f.name, f"corrupt gzip data ({e})", where()) from None
            if out:
                yield out
            if d.eof:
                block = d.unused_data.lstrip(b"\x00")  # next member; trailing NUL padding is allowed
                d = zlib.decompressobj(wbits=31)
                fed = False
            else:
                block = b""
    if fed and not d.eof:
        raise BadInput(f.name, "truncated gzip file (the stream ends before its end marker)", where())


def _zstd_chunks(f: InputFile, on_bytes, where: Callable[[], str]) -> Iterator[bytes]:
    """Decompressed blocks of a (multi-frame) zstd file; a truncated frame raises ``BadInput``.

    zstandard's ``stream_reader`` returns a truncated frame's data without an error, so the frames
    are decoded here and ``eof`` checked at the end.
    """
    zstd = _zstandard()
    dctx = zstd.ZstdDecompressor()
    d = dctx.decompressobj()
    fed = False
    for block in _raw_chunks(f, on_bytes):
        while block:
            fed = True
            try:
                out = d.decompress(block)
            except zstd.ZstdError as e:
                raise BadInput(f.name, f"corrupt zstd data ({e})", where()) from None
            if out:
                yield out
            if d.eof:
                block = d.unused_data
                d = dctx.decompressobj()
                fed = False
            else:
                block = b""
    if fed and not d.eof:
        raise BadInput(f.name, "truncated zstd file (the last frame is incomplete)", where())


def _lines(chunks: Iterator[bytes]) -> Iterator[bytes]:
    pending: list[bytes] = []
    for chunk in chunks:
        if b"\n" not in chunk:
            pending.append(chunk)
            continue
        pieces = chunk.split(b"\n")
        if pending:
            pieces[0] = b"".join(pending) + pieces[0]
        pending = [pieces.pop()] if pieces[-1] else []
        yield from pieces
    if pending:
        yield b"".join(pending)


class _Counter:
    """Documents read and skipped-as-empty in one file."""

    def __init__(self):
        self.documents = 0
        self.empty_documents = 0


def iter_documents(f: InputFile, text_field: str, on_bytes: Callable[[int], None] = lambda n: None,
                   counter: _Counter | None = None) -> Iterator[tuple[str, str]]:
    """``(doc_id, text)`` of every document of ``f`` in file order; ``BadInput`` on a bad file.

    A record whose text is empty is skipped and counted (``counter.empty_documents``); a file with
    no non-empty document is bad ("empty").
    """
    c = counter if counter is not None else _Counter()
    if f.fmt == ".txt":
        raw = Path(f.path).read_bytes()
        on_bytes(len(raw))
        if not raw.strip():
            raise BadInput(f.name, "empty file (no text)")
        try:
            text, _ = _prep.decode_text(raw, f.name)
        except _prep.BadTextFile as e:
            raise BadInput(f.name, e.reason) from None
        c.documents += 1
        yield f.name, text
        return
    if f.fmt == ".parquet":
        yield from _parquet_documents(f, text_field, on_bytes, c)
    else:
        line_no = 0
        where = lambda: f"after line {line_no}"  # noqa: E731
        chunks = {".jsonl": lambda: _raw_chunks(f, on_bytes),
                  ".jsonl.gz": lambda: _gzip_chunks(f, on_bytes, where),
                  ".jsonl.zst": lambda: _zstd_chunks(f, on_bytes, where)}[f.fmt]()
        for line in _lines(chunks):
            line_no += 1
            if not line.strip():
                continue
            at = f"line {line_no}"
            try:
                record = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise BadInput(f.name, f"not valid UTF-8 (byte 0x{line[e.start:e.start + 1].hex().upper()} "
                               f"at column {e.start + 1})", at) from None
            except ValueError as e:
                raise BadInput(f.name, f"not valid JSON ({getattr(e, 'msg', e)})", at) from None
            if not isinstance(record, dict):
                raise BadInput(f.name, f"a JSON {type(record).__name__}, not an object", at)
            if text_field not in record:
                keys = ", ".join(list(record)[:8]) or "none"
                raise BadInput(f.name, f"no field {text_field!r} (fields: {keys}); set --text_field", at)
            text = record[text_field]
            if not isinstance(text, str):
                raise BadInput(f.name, f"field {text_field!r} is a {type(text).__name__}, not a string", at)
            if not text:
                c.empty_documents += 1
                continue
            c.documents += 1
            yield f"{f.name}:{line_no}", text
    if c.documents == 0:
        raise BadInput(f.name, "empty file (no documents)" if c.empty_documents == 0 else
                       f"no non-empty documents ({c.empty_documents} with empty {text_field!r})")


def _parquet_documents(f: InputFile, text_field: str, on_bytes, c: _Counter) -> Iterator[tuple[str, str]]:
    pa, pq = _parquet()
    try:
        pf = pq.ParquetFile(f.path)
    except (pa.ArrowException, OSError) as e:
        raise BadInput(f.name, f"not a readable parquet file, truncated or corrupt ({_first_line(e)})") from None
    with contextlib.closing(pf):
        schema = pf.schema_arrow
        if text_field not in schema.names:
            raise BadInput(f.name, f"no column {text_field!r} (columns: {', '.join(schema.names[:8])}); "
                           "set --text_field")
        typ = schema.field(text_field).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)
                or getattr(pa.types, "is_string_view", lambda t: False)(typ)):
            raise BadInput(f.name, f"column {text_field!r} has type {typ}, not string")
        n_rows = pf.metadata.num_rows
        row = 0
        reported = 0
        try:
            for batch in pf.iter_batches(batch_size=1024, columns=[text_field]):
                col = batch.column(0)
                if col.null_count:
                    first = next(i for i, v in enumerate(col.is_valid().to_pylist()) if not v)
                    raise BadInput(f.name, f"{text_field!r} is null", f"row {row + first}")
                for i, text in enumerate(col.to_pylist()):
                    if not text:
                        c.empty_documents += 1
                        continue
                    c.documents += 1
                    yield f"{f.name}:{row + i}", text
                row += batch.num_rows
                done = f.size * row // max(1, n_rows)
                on_bytes(done - reported)
                reported = done
        except (pa.ArrowException, OSError) as e:
            raise BadInput(f.name, f"unreadable parquet data ({_first_line(e)})", f"row {row}") from None
        on_bytes(f.size - reported)


# --------------------------------------------------------------------------- #
# tokenizers
# --------------------------------------------------------------------------- #
_TOKENIZER_CACHE: dict[tuple[str, str | None], Any] = {}


def _load_tokenizer(kind: str, path: str | None):
    key = (kind, path)
    if key not in _TOKENIZER_CACHE:
        _TOKENIZER_CACHE[key] = _tok.ByteTokenizer() if kind == "bytes" else _tok.BPETokenizer.from_file(path)
    return _TOKENIZER_CACHE[key]


def bpe_sample(files: Sequence[InputFile], text_field: str, sample_bytes: int, skip_bad: bool) -> list[str]:
    """Training text for BPE: train-split documents, ``sample_bytes // len(files)`` from each file's start.

    Deterministic (files in sorted order, documents in file order, the last one cut to the
    budget in characters); every file contributes, so one large shard does not dominate.
    """
    per_file = max(1, sample_bytes // max(1, len(files)))
    texts: list[str] = []
    for f in files:
        budget = per_file
        try:
            for doc_id, text in iter_documents(f, text_field):
                if _prep.is_val_document(doc_id):
                    continue
                if len(text) >= budget:
                    texts.append(text[:budget])
                    break
                texts.append(text)
                budget -= len(text)
        except BadInput:
            if not skip_bad:
                raise
    return texts


# --------------------------------------------------------------------------- #
# parts: one per input file
# --------------------------------------------------------------------------- #
def part_stem(name: str) -> str:
    return hashlib.sha1(name.encode("utf-8")).hexdigest()[:20]


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _atomic_write_json(path: Path, obj: Any) -> None:
    tmp = _tmp(path)
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(obj, fh, indent=1, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class _SplitPart:
    """One split of a part being written: tokens and document lengths to temp files, hashed."""

    def __init__(self, parts_dir: Path, stem: str, split: str):
        self.tokens_path = parts_dir / f"{stem}.{split}.tokens"
        self.lengths_path = parts_dir / f"{stem}.{split}.lengths"
        self.tok_fh = open(_tmp(self.tokens_path), "wb")
        self.len_fh = open(_tmp(self.lengths_path), "wb")
        self.tok_sha, self.len_sha = hashlib.sha256(), hashlib.sha256()
        self.tokens = self.documents = self.text_bytes = 0

    def write(self, tokens: bytes, lengths: np.ndarray, text_bytes: int) -> None:
        raw_len = lengths.astype("<i8").tobytes()
        self.tok_fh.write(tokens)
        self.len_fh.write(raw_len)
        self.tok_sha.update(tokens)
        self.len_sha.update(raw_len)
        self.tokens += int(lengths.sum())
        self.documents += int(lengths.size)
        self.text_bytes += text_bytes

    def finish(self) -> dict[str, Any]:
        for fh in (self.tok_fh, self.len_fh):
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        os.replace(_tmp(self.tokens_path), self.tokens_path)
        os.replace(_tmp(self.lengths_path), self.lengths_path)
        return {"tokens": self.tokens, "documents": self.documents, "text_bytes": self.text_bytes,
                "tokens_sha256": self.tok_sha.hexdigest(), "lengths_sha256": self.len_sha.hexdigest()}

    def discard(self) -> None:
        for fh, p in ((self.tok_fh, self.tokens_path), (self.len_fh, self.lengths_path)):
            fh.close()
            _tmp(p).unlink(missing_ok=True)


def _encode_batch(tok, dtype: np.dtype, docs: list[tuple[str, str]], out: dict[str, _SplitPart]) -> int:
    """Tokenise one batch, each document followed by the separator; returns the tokens made."""
    by_split: dict[str, list[int]] = {"train": [], "val": []}
    for i, (doc_id, _) in enumerate(docs):
        by_split["val" if _prep.is_val_document(doc_id) else "train"].append(i)
    total = 0
    if tok.kind == "bytes":
        encoded = [text.encode("utf-8") for _, text in docs]
        for split, idx in by_split.items():
            if not idx:
                continue
            blobs = [encoded[i] + BYTES_SEPARATOR for i in idx]
            lengths = np.fromiter((len(b) for b in blobs), dtype=np.int64, count=len(blobs))
            out[split].write(b"".join(blobs), lengths, int(lengths.sum()) - len(blobs) * len(BYTES_SEPARATOR))
            total += int(lengths.sum())
        return total
    ids = tok.encode_batch([text for _, text in docs])
    for split, idx in by_split.items():
        if not idx:
            continue
        arrays = [np.asarray(ids[i] + [tok.eot_id], dtype=dtype) for i in idx]
        lengths = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
        text_bytes = sum(len(docs[i][1].encode("utf-8")) for i in idx)
        out[split].write(np.concatenate(arrays).astype(dtype.newbyteorder("<")).tobytes(), lengths, text_bytes)
        total += int(lengths.sum())
    return total


@dataclass(frozen=True)
class _Job:
    file: InputFile
    parts_dir: str
    text_field: str
    tokenizer_kind: str
    tokenizer_path: str | None
    dtype: str
    skip_bad: bool
    batch_bytes: int


_PROGRESS_QUEUE = None


def _init_worker(progress_queue) -> None:
    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = progress_queue


def process_file(job: _Job, report: Callable[[int, int, int], None] | None = None) -> dict[str, Any]:
    """Tokenise one input file into its part; returns the manifest (written last, atomically).

    ``report(disk_bytes, text_bytes, tokens)`` receives progress deltas. A bad file raises
    ``BadInput``, or with ``skip_bad`` gives a manifest with ``"skipped": reason`` and no tokens.
    """
    if report is None:
        q = _PROGRESS_QUEUE
        report = (lambda a, b, c: q.put((a, b, c))) if q is not None else (lambda a, b, c: None)
    f = job.file
    parts_dir = Path(job.parts_dir)
    stem = part_stem(f.name)
    tok = _load_tokenizer(job.tokenizer_kind, job.tokenizer_path)
    dtype = np.dtype(job.dtype)
    pending = {"disk": 0, "text": 0, "tokens": 0, "t": time.monotonic()}

    def flush(force: bool = False) -> None:
        if force or time.monotonic() - pending["t"] > 0.25:
            if pending["disk"] or pending["text"] or pending["tokens"]:
                report(pending["disk"], pending["text"], pending["tokens"])
            pending.update(disk=0, text=0, tokens=0, t=time.monotonic())

    def on_bytes(n: int) -> None:
        pending["disk"] += n

    splits = {s: _SplitPart(parts_dir, stem, s) for s in SPLITS}
    counter = _Counter()
    manifest: dict[str, Any] = {"stream_version": STREAM_VERSION, **asdict(f)}
    del manifest["path"]  # the manifest holds nothing machine-specific beyond the stat check
    try:
        batch: list[tuple[str, str]] = []
        size = 0
        for doc in iter_documents(f, job.text_field, on_bytes, counter):
            batch.append(doc)
            size += len(doc[1])
            if size >= job.batch_bytes:
                pending["tokens"] += _encode_batch(tok, dtype, batch, splits)
                pending["text"] += size
                batch, size = [], 0
                flush()
        if batch:
            pending["tokens"] += _encode_batch(tok, dtype, batch, splits)
            pending["text"] += size
        manifest["splits"] = {s: p.finish() for s, p in splits.items()}
        manifest["empty_documents"] = counter.empty_documents
        manifest["skipped"] = None
    except BadInput as e:
        for p in splits.values():
            p.discard()
        if not job.skip_bad:
            raise
        manifest.update(splits={}, empty_documents=0, skipped=str(e.reason) + (f" ({e.where})" if e.where else ""))
    except BaseException:
        for p in splits.values():
            p.discard()
        raise
    flush(force=True)
    _atomic_write_json(parts_dir / f"{stem}.json", manifest)
    return manifest


def _finished_manifest(parts_dir: Path, f: InputFile) -> dict[str, Any] | None:
    """The manifest of ``f``'s part if it is complete and made from ``f`` as it is now."""
    stem = part_stem(f.name)
    try:
        m = json.loads((parts_dir / f"{stem}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (m.get("stream_version"), m.get("name"), m.get("size"), m.get("mtime_ns")) != \
            (STREAM_VERSION, f.name, f.size, f.mtime_ns):
        return None
    for split, info in (m.get("splits") or {}).items():
        tp, lp = parts_dir / f"{stem}.{split}.tokens", parts_dir / f"{stem}.{split}.lengths"
        if not tp.is_file() or not lp.is_file() or lp.stat().st_size != 8 * info["documents"]:
            return None
    return m


# --------------------------------------------------------------------------- #
# the run
# --------------------------------------------------------------------------- #
def _sha256_file(path: Path) -> str:
    return _prep.sha256_file(path)


def _is_url(root: str) -> bool:
    return "://" in root and not root.startswith("file://")


def _local_path(root: str) -> Path | None:
    if _is_url(root):
        return None
    return Path(root[len("file://"):] if root.startswith("file://") else root).expanduser()


def default_work_dir(out: str) -> Path:
    local = _local_path(out)
    if local is None:
        raise StreamError(f"--out={out} is not a local path; pass --work_dir=<local folder> for the parts")
    return local.with_name(local.name + ".parts")


def part_options(args: argparse.Namespace, tokenizer_sha: str | None) -> dict[str, Any]:
    """What a part's tokens depend on: a work folder holds parts made with these options only.

    Not --workers, --skip_bad (a part of a good file is the same either way; a file skipped as
    bad is read again by a run without it) or --chunk_tokens (the store's chunking only).
    """
    return {
        "stream_version": STREAM_VERSION,
        "tokenizer": args.tokenizer,
        "vocab_size": args.vocab_size,
        "tokenizer_file_sha256": tokenizer_sha,
        "bpe_sample_bytes": args.bpe_sample_bytes if args.tokenizer == "bpe" and not args.tokenizer_file else None,
        "text_field": args.text_field,
    }


def store_options(parts: dict[str, Any], args: argparse.Namespace, files: Sequence[InputFile]) -> dict[str, Any]:
    """What the store depends on: the part options, the input listing, --skip_bad, --chunk_tokens."""
    listing = hashlib.sha256("".join(f"{f.name}\t{f.size}\n" for f in files).encode("utf-8")).hexdigest()
    return {**parts, "skip_bad": bool(args.skip_bad), "chunk_tokens": args.chunk_tokens,
            "inputs": {"files": len(files), "bytes": sum(f.size for f in files), "listing_sha256": listing}}


def _fingerprint(options: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(options, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def _check_state(work: Path, options: dict[str, Any]) -> None:
    """Record the options in a new work folder; refuse one that was started with others."""
    state_path = work / STATE_FILE
    if state_path.is_file():
        try:
            old = json.loads(state_path.read_text(encoding="utf-8"))["options"]
        except (OSError, ValueError, KeyError):
            raise StreamError(f"{state_path} is unreadable; delete the work folder {work} to start afresh") from None
        if old != options:
            diff = ", ".join(f"{k}={old.get(k)!r} then, {options.get(k)!r} now"
                             for k in sorted(set(old) | set(options)) if old.get(k) != options.get(k))
            raise StreamError(f"work folder {work} was started with other options ({diff}); "
                              "rerun the first command, or pass another --work_dir (or delete it)")
        return
    _atomic_write_json(state_path, {"options": options, "fingerprint": _fingerprint(options)})


@contextlib.contextmanager
def _locked(work: Path):
    import fcntl

    with open(work / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise StreamError(f"work folder {work} is in use by another run") from None
        yield


def _check_out(out: str, fingerprint: str) -> bool:
    """True if ``out`` already holds this very store; refuse to overwrite anything else."""
    if _store.is_store(out):
        meta = _store.read_store_meta(out)
        if meta.get("stream", {}).get("options_fingerprint") == fingerprint:
            return True
        raise StreamError(f"--out={out} already holds a token store made from other inputs or options; "
                          "choose another --out or delete it")
    local = _local_path(out)
    if local is not None and local.exists():
        extra = sorted(p.name for p in local.iterdir() if p.name not in (*SPLITS, TOKENIZER_FILE))
        if not local.is_dir() or extra:
            raise StreamError(f"--out={out} exists and is not a token store (it holds {', '.join(extra[:3])}); "
                              "refusing to overwrite it")
    return False


class _Progress:
    def __init__(self, total_bytes: int, enabled: bool):
        self.t0 = time.monotonic()
        self.disk = self.text = self.tokens = 0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                            desc="tokenising", dynamic_ncols=True, smoothing=0.1)

    def __call__(self, disk: int, text: int, tokens: int) -> None:
        self.disk += disk
        self.text += text
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(disk)
            dt = max(1e-9, time.monotonic() - self.t0)
            self.bar.set_postfix_str(f"{self.text / dt / 1e6:.1f} MB/s text, {self.tokens / dt / 1e6:.2f} M tok/s",
                                     refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _run_parts(jobs: list[_Job], workers: int, progress: _Progress, parts_dir: Path) -> list[dict[str, Any]]:
    stop_after = int(os.environ.get(STOP_AFTER_PARTS_ENV, "0") or 0)
    done: list[dict[str, Any]] = []

    def finished(m: dict[str, Any], pool=None) -> None:
        done.append(m)
        if stop_after and len(done) >= stop_after:
            if pool is not None:
                pool.terminate()
            os._exit(75)

    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            finished(process_file(job, progress))
        return done
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with ctx.Pool(min(workers, len(jobs)), initializer=_init_worker, initargs=(q,)) as pool:
        pending = [pool.apply_async(process_file, (job,)) for job in jobs]
        try:
            while pending:
                try:
                    progress(*q.get(timeout=0.2))
                except queue.Empty:
                    pass
                still = []
                for r in pending:
                    if r.ready():
                        finished(r.get(), pool)  # re-raises a worker's BadInput here
                    else:
                        still.append(r)
                pending = still
        except BaseException:
            pool.terminate()
            raise
        while True:
            try:
                progress(*q.get_nowait())
            except queue.Empty:
                break
    return done


def _assemble(out: str, files: list[InputFile], manifests: dict[str, dict[str, Any]], parts_dir: Path,
              dtype: np.dtype, chunk_tokens: int, block_tokens: int = 1 << 21) -> dict[str, dict[str, int]]:
    """Write the store's splits from the parts in sorted input order, checking each part's hashes."""
    splits = {}
    for split in SPLITS:
        writer = _store.TokenStoreWriter(out, split, dtype=dtype, chunk_tokens=chunk_tokens)
        for f in files:
            info = (manifests[f.name].get("splits") or {}).get(split)
            if not info or not info["documents"]:
                continue
            stem = part_stem(f.name)
            tp, lp = parts_dir / f"{stem}.{split}.tokens", parts_dir / f"{stem}.{split}.lengths"
            tok_sha, len_sha = hashlib.sha256(), hashlib.sha256()
            with open(tp, "rb") as tfh, open(lp, "rb") as lfh:
                while True:
                    lengths = np.fromfile(lfh, dtype="<i8", count=1 << 16)
                    if not lengths.size:
                        break
                    len_sha.update(lengths.tobytes())
                    ends = np.cumsum(lengths)
                    lo = 0
                    while lo < lengths.size:  # whole documents, about block_tokens at a time
                        base = int(ends[lo - 1]) if lo else 0
                        hi = max(lo + 1, int(np.searchsorted(ends, base + block_tokens, side="right")))
                        n = int(ends[hi - 1]) - base
                        tokens = np.fromfile(tfh, dtype=dtype.newbyteorder("<"), count=n)
                        if tokens.size != n:
                            raise StreamError(f"part {tp} is shorter than its manifest says; delete it and rerun")
                        tok_sha.update(tokens.tobytes())
                        writer.append(tokens.astype(dtype, copy=False), lengths[lo:hi])
                        lo = hi
            if (tok_sha.hexdigest(), len_sha.hexdigest()) != (info["tokens_sha256"], info["lengths_sha256"]):
                raise StreamError(f"part {tp} ({f.name}) does not match its manifest's sha256; "
                                  "delete it and rerun")
        splits[split] = writer.close()
    return splits


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m msar_jax.data.stream", description=__doc__.split("\n\n")[0],
                                 epilog="Split rule: " + SPLIT_RULE)
    ap.add_argument("inputs", nargs="+", help="folders, globs or files (.txt .jsonl .jsonl.gz .jsonl.zst .parquet)")
    ap.add_argument("--out", required=True, help="store root: a local path or a kvstore URL (gs://...)")
    ap.add_argument("--work_dir", default=None, help="local folder for the parts (default: <out>.parts)")
    ap.add_argument("--tokenizer", default="bytes", choices=("bytes", "bpe"))
    ap.add_argument("--vocab_size", type=int, default=None, help="BPE vocab size to train (default 8192)")
    ap.add_argument("--tokenizer_file", default=None, help="an existing BPE tokenizer.json (no training)")
    ap.add_argument("--bpe_sample_bytes", type=int, default=DEFAULT_BPE_SAMPLE_BYTES,
                    help="characters of train documents to train BPE on, spread evenly over the files")
    ap.add_argument("--text_field", default="text", help="the text field of .jsonl records / column of .parquet")
    ap.add_argument("--workers", type=int, default=1, help="tokenising processes (each takes whole files)")
    ap.add_argument("--skip_bad", action="store_true",
                    help="leave out bad files (counted, listed in meta.json) instead of stopping")
    ap.add_argument("--chunk_tokens", type=int, default=_store.DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--batch_bytes", type=int, default=DEFAULT_BATCH_BYTES,
                    help="characters of text per tokenised batch (bounds each worker's memory)")
    ap.add_argument("--keep_parts", action="store_true", help="keep the work folder after the store is written")
    ap.add_argument("--no_progress", action="store_true", help="no progress bar")
    return ap


def _validate(args: argparse.Namespace) -> None:
    if args.workers < 1:
        raise StreamError(f"--workers={args.workers}: must be >= 1")
    if args.batch_bytes < 1 or args.chunk_tokens < 1 or args.bpe_sample_bytes < 1:
        raise StreamError("--batch_bytes, --chunk_tokens and --bpe_sample_bytes must be positive")
    if args.tokenizer == "bytes":
        if args.vocab_size not in (None, 256) or args.tokenizer_file:
            raise StreamError("--tokenizer=bytes has vocab 256 and takes no --vocab_size / --tokenizer_file")
    elif args.tokenizer_file:
        if not Path(args.tokenizer_file).is_file():
            raise StreamError(f"--tokenizer_file={args.tokenizer_file}: no such file")
    elif args.vocab_size is None:
        args.vocab_size = 8192


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Prepare the store ``args.out``; returns its meta (and prints a summary line)."""
    _validate(args)
    t0 = time.monotonic()
    files = list_inputs(args.inputs)
    work = Path(args.work_dir).expanduser() if args.work_dir else default_work_dir(args.out)
    tok_sha = _sha256_file(Path(args.tokenizer_file)) if args.tokenizer_file else None
    options = part_options(args, tok_sha)
    store_opts = store_options(options, args, files)
    fingerprint = _fingerprint(store_opts)
    if _check_out(args.out, fingerprint):
        meta = _store.read_store_meta(args.out)
        print(f"{args.out}: already holds this store (options fingerprint {fingerprint}); nothing to do")
        return meta
    work.mkdir(parents=True, exist_ok=True)
    parts_dir = work / "parts"
    parts_dir.mkdir(exist_ok=True)
    with _locked(work):
        _check_state(work, options)
        for stale in parts_dir.glob(".*.tmp*"):  # half-written files of a killed run (never a finished part)
            stale.unlink(missing_ok=True)

        # tokenizer
        tok_info: dict[str, Any]
        if args.tokenizer == "bytes":
            tok, tok_path = _tok.ByteTokenizer(), None
            tok_info = {"kind": "bytes", "vocab_size": 256, "eot_id": None, "eot_token": None, "file": None,
                        "document_separator": BYTES_SEPARATOR.decode()}
        else:
            tok_path = str(work / TOKENIZER_FILE)
            if not Path(tok_path).is_file():
                if args.tokenizer_file:
                    shutil.copyfile(args.tokenizer_file, _tmp(Path(tok_path)))
                else:
                    texts = bpe_sample(files, args.text_field, args.bpe_sample_bytes, args.skip_bad)
                    if not texts:
                        raise StreamError("no train documents to train BPE on")
                    _tok.BPETokenizer.train(texts, vocab_size=args.vocab_size).save(_tmp(Path(tok_path)))
                    del texts
                os.replace(_tmp(Path(tok_path)), tok_path)
            tok = _load_tokenizer("bpe", tok_path)
            if args.tokenizer_file and args.vocab_size not in (None, tok.vocab_size):
                raise StreamError(f"--vocab_size={args.vocab_size} but {args.tokenizer_file} has vocab {tok.vocab_size}")
            tok_info = {"kind": "bpe", "vocab_size": int(tok.vocab_size), "eot_id": tok.eot_id,
                        "eot_token": tok.eot_token, "file": TOKENIZER_FILE, "document_separator": tok.eot_token,
                        "sha256": _sha256_file(Path(tok_path)),
                        "trained_on": None if args.tokenizer_file else
                        f"train documents, {args.bpe_sample_bytes} characters spread evenly over the input files"}
        tok_info["separator_placement"] = "appended to every document (the last one too)"
        dtype = _prep._token_dtype(tok.vocab_size)

        # parts
        manifests: dict[str, dict[str, Any]] = {}
        todo = []
        for f in files:
            m = _finished_manifest(parts_dir, f)
            if m is not None and (args.skip_bad or not m.get("skipped")):  # else: read again, and stop on it
                manifests[f.name] = m
            else:
                todo.append(_Job(f, str(parts_dir), args.text_field, args.tokenizer, tok_path, dtype.name,
                                 args.skip_bad, args.batch_bytes))
        progress = _Progress(sum(j.file.size for j in todo), enabled=not args.no_progress)
        try:
            for m in _run_parts(todo, args.workers, progress, parts_dir):
                manifests[m["name"]] = m
        finally:
            progress.close()

        # the store, meta.json last
        t_parts = time.monotonic()
        splits = _assemble(args.out, files, manifests, parts_dir, dtype, args.chunk_tokens)
        if tok_path:
            kv = _store.ts.KvStore.open(_store.kvstore_spec(args.out)).result()
            kv.write(TOKENIZER_FILE, Path(tok_path).read_bytes()).result()
        skipped = [{"name": f.name, "reason": manifests[f.name]["skipped"]} for f in files
                   if manifests[f.name].get("skipped")]
        text_bytes = {s: sum((m.get("splits") or {}).get(s, {}).get("text_bytes", 0) for m in manifests.values())
                      for s in SPLITS}
        meta = {
            "dtype": dtype.name,
            "tokenizer": tok_info,
            "splits": splits,
            "created_by": "msar_jax.data.stream",
            "source": {"inputs": list(args.inputs), "text_field": args.text_field, **store_opts["inputs"],
                       "listing_rule": "sha256 over lines '<relative path>\\t<size>\\n' in sorted order"},
            "split": {"rule": SPLIT_RULE, "modulus": SPLIT_MODULUS},
            "stream": {
                "options_fingerprint": fingerprint,
                "options": store_opts,
                "files_used": len(files) - len(skipped),
                "skipped_files": skipped,
                "empty_documents": sum(m.get("empty_documents", 0) for m in manifests.values()),
                "text_bytes": text_bytes,
            },
        }
        _store.write_meta(args.out, meta)
    if not args.keep_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
        for name in (STATE_FILE, TOKENIZER_FILE, ".lock"):
            (work / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            work.rmdir()
    t_end = time.monotonic()
    dt = max(1e-9, t_end - t0)
    n_tok = sum(s["tokens"] for s in splits.values())
    n_text = sum(text_bytes.values())
    if not splits["val"]["documents"]:
        print(f"warning: the split rule sent none of the {splits['train']['documents']} documents to val",
              file=sys.stderr)
    print(f"wrote {args.out}: {len(files)} files ({len(files) - len(todo)} parts reused, {len(skipped)} skipped), "
          f"documents train/val = {splits['train']['documents']}/{splits['val']['documents']}, "
          f"tokens train/val = {splits['train']['tokens']}/{splits['val']['tokens']} ({dtype.name}); "
          f"{dt:.1f} s ({t_parts - t0:.1f} s parts, {t_end - t_parts:.1f} s store), "
          f"{n_text / dt / 1e6:.1f} MB/s text, {n_tok / dt / 1e6:.2f} M tokens/s")
    return {"format": _store.FORMAT, "format_version": _store.FORMAT_VERSION, **meta}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except (StreamError, BadInput, _store.StoreError, ImportError, OSError) as e:
        hint = "; pass --skip_bad to leave such files out" if isinstance(e, BadInput) else ""
        print(f"error: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: finished parts are kept; rerun the same command to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
