"""msar_jax.data.stream: formats, split, resume, workers, bad inputs, memory (docs/training.md §6)."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

from msar_jax.data import stream, token_store  # noqa: E402

prep = importlib.import_module("msar_jax.data.prepare")
REPO = Path(__file__).resolve().parents[1]


def _docs(tag: str, n: int) -> list[str]:
    return [f"{tag} document {i}: " + " ".join(f"w{(i * 7 + k) % 97}" for k in range(5 + i % 11))
            for i in range(n)]


def _jsonl_bytes(texts, field="text") -> bytes:
    return "".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(texts)).encode()


def write_file(path: Path, texts: list[str], field: str = "text") -> None:
    """``texts`` as one file of the format ``path``'s suffix names."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = stream.format_of(path.name)
    if fmt == ".txt":
        assert len(texts) == 1
        path.write_text(texts[0], encoding="utf-8")
    elif fmt == ".jsonl":
        path.write_bytes(_jsonl_bytes(texts, field))
    elif fmt == ".jsonl.gz":
        path.write_bytes(gzip.compress(_jsonl_bytes(texts, field)))
    elif fmt == ".jsonl.zst":
        path.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(texts, field)))
    else:
        pq.write_table(pa.table({field: texts, "n": list(range(len(texts)))}), path, row_group_size=16)


def doc_ids(name: str, texts: list[str]) -> list[str]:
    fmt = stream.format_of(name)
    if fmt == ".txt":
        return [name]
    if fmt == ".parquet":
        return [f"{name}:{i}" for i in range(len(texts))]
    return [f"{name}:{i + 1}" for i in range(len(texts))]  # 1-based line numbers


def make_corpus(root: Path, formats=(".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"), n=40):
    """A corpus with every format; returns ``{relative name: texts}``."""
    files: dict[str, list[str]] = {}
    for k, fmt in enumerate(formats):
        if fmt == ".txt":
            for j in range(6):
                files[f"txt/t{j}.txt"] = [_docs(f"txt{j}", 1)[0]]
        else:
            files[f"sub{k}/shard{k}{fmt}"] = _docs(fmt, n)
    for name, texts in files.items():
        write_file(root / name, texts)
    return files


def expected_splits(files: dict[str, list[str]]) -> dict[str, bytes]:
    """The bytes store's splits by the rule: sorted files, file order, sha1 % 20 of the doc id."""
    out = {"train": [], "val": []}
    for name in sorted(files):
        for doc_id, text in zip(doc_ids(name, files[name]), files[name]):
            out["val" if prep.is_val_document(doc_id) else "train"].append(text.encode() + b"\n\n")
    return {s: b"".join(v) for s, v in out.items()}


def read_split(root: Path, split: str) -> bytes:
    sp = token_store.open_split(str(root), split)
    return sp.read(0, sp.num_tokens).tobytes()


def store_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def prepare(inputs, out, *extra, expect=0):
    rc = stream.main([*map(str, inputs), f"--out={out}", "--no_progress", *extra])
    assert rc == expect
    return json.loads((Path(out) / "meta.json").read_text()) if rc == 0 else None


@pytest.mark.parametrize("fmt", [".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet"])
def test_each_format_gives_the_documents_in_order(tmp_path, fmt):
    files = make_corpus(tmp_path / "c", formats=(fmt,), n=60)
    meta = prepare([tmp_path / "c"], tmp_path / "out")
    want = expected_splits(files)
    for split in ("train", "val"):
        assert read_split(tmp_path / "out", split) == want[split]
    assert meta["splits"]["val"]["documents"] >= 1
    assert sum(s["documents"] for s in meta["splits"].values()) == sum(map(len, files.values()))


def test_mixed_corpus_split_by_document_and_independent_of_location(tmp_path):
    files = make_corpus(tmp_path / "a" / "corpus")
    meta = prepare([tmp_path / "a" / "corpus"], tmp_path / "out_a")
    want = expected_splits(files)
    assert read_split(tmp_path / "out_a", "train") == want["train"]
    assert read_split(tmp_path / "out_a", "val") == want["val"]
    # every stored document is one whole input document, each in the split its id's hash names
    sp = token_store.open_split(str(tmp_path / "out_a"), "val")
    starts = np.append(sp.doc_starts, sp.num_tokens)
    val_texts = {sp.read(int(a), int(b)).tobytes()[:-2].decode() for a, b in zip(starts[:-1], starts[1:])}
    by_rule = {t for name, ts in files.items() for d, t in zip(doc_ids(name, ts), ts) if prep.is_val_document(d)}
    assert val_texts == by_rule and len(by_rule) >= 2
    assert meta["split"]["rule"] == stream.SPLIT_RULE and "% 20 == 0" in meta["split"]["rule"]
    # the same corpus elsewhere (another machine's path) gives the same store, given by a glob too
    (tmp_path / "b").mkdir()
    os.rename(tmp_path / "a" / "corpus", tmp_path / "b" / "corpus")
    prepare([tmp_path / "b" / "corpus"], tmp_path / "out_b")
    assert read_split(tmp_path / "out_b", "train") == want["train"]
    prepare([f"{tmp_path}/b/corpus/**/*.*"], tmp_path / "out_glob")
    assert read_split(tmp_path / "out_glob", "val") == want["val"]


def test_workers_2_equal_workers_1_bytes_and_bpe(tmp_path):
    make_corpus(tmp_path / "c")
    for tok in (["--tokenizer=bytes"], ["--tokenizer=bpe", "--vocab_size=300", "--bpe_sample_bytes=4000"]):
        name = tok[0].split("=")[1]
        prepare([tmp_path / "c"], tmp_path / f"{name}1", *tok, "--workers=1")
        prepare([tmp_path / "c"], tmp_path / f"{name}2", *tok, "--workers=2")
        assert store_files(tmp_path / f"{name}1") == store_files(tmp_path / f"{name}2")
    meta = json.loads((tmp_path / "bpe1" / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and (tmp_path / "bpe1" / "tokenizer.json").is_file()
    from msar_jax.data import tokenizers

    tok = tokenizers.load_tokenizer(tmp_path / "bpe1")
    sp = token_store.open_split(str(tmp_path / "bpe1"), "train")
    first = sp.read(0, int(sp.doc_starts[1]))
    assert first[-1] == tok.eot_id and tok.decode(first[:-1]).startswith(".jsonl document 0")  # sub1/shard1.jsonl sorts first


def test_bpe_tokenizer_file_is_used_and_kept(tmp_path):
    make_corpus(tmp_path / "c", formats=(".jsonl",))
    prepare([tmp_path / "c"], tmp_path / "first", "--tokenizer=bpe", "--vocab_size=280")
    prepare([tmp_path / "c"], tmp_path / "second", "--tokenizer=bpe",
            f"--tokenizer_file={tmp_path / 'first' / 'tokenizer.json'}")
    assert read_split(tmp_path / "first", "train") == read_split(tmp_path / "second", "train")
    assert (tmp_path / "second" / "tokenizer.json").read_bytes() == \
        (tmp_path / "first" / "tokenizer.json").read_bytes()


def test_kill_and_resume_is_byte_identical(tmp_path):
    files = make_corpus(tmp_path / "c")
    out = tmp_path / "out"
    env = {**os.environ, stream.STOP_AFTER_PARTS_ENV: "2"}
    cmd = [sys.executable, "-m", "msar_jax.data.stream", str(tmp_path / "c"), f"--out={out}", "--no_progress"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 75, proc.stderr
    parts = tmp_path / "out.parts" / "parts"
    assert len(list(parts.glob("*.json"))) == 2 and not (out / "meta.json").exists()
    (parts / ".x.train.tokens.tmp999").write_bytes(b"half a part")  # a killed writer's leftovers
    finished = {p.name: p.stat().st_mtime_ns for p in parts.iterdir() if not p.name.startswith(".")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"{len(files)} files (2 parts reused, 0 skipped)" in proc.stdout
    assert not (tmp_path / "out.parts").exists()  # removed once the store is written
    prepare([tmp_path / "c"], tmp_path / "fresh")
    assert store_files(out) == store_files(tmp_path / "fresh")
    # the finished parts were reused, not rewritten
    prepare([tmp_path / "c"], tmp_path / "kept", "--keep_parts")
    assert set(finished) <= {p.name for p in (tmp_path / "kept.parts" / "parts").iterdir()}
    # the same command again is a no-op; another over a finished store is refused
    assert stream.main([str(tmp_path / "c"), f"--out={out}", "--no_progress"]) == 0
    assert stream.main([str(tmp_path / "c"), f"--out={out}", "--no_progress", "--text_field=body"]) == 1


def test_other_options_over_the_same_work_dir_are_refused(tmp_path, capsys):
    make_corpus(tmp_path / "c", formats=(".jsonl",))
    work = tmp_path / "work"
    prepare([tmp_path / "c"], tmp_path / "o1", f"--work_dir={work}", "--keep_parts")
    prepare([tmp_path / "c"], tmp_path / "o2", f"--work_dir={work}", "--workers=2", "--keep_parts")  # same
    capsys.readouterr()
    prepare([tmp_path / "c"], tmp_path / "o3", f"--work_dir={work}", "--tokenizer=bpe", expect=1)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(work) in err and "tokenizer='bytes' then, 'bpe' now" in err
    assert not (tmp_path / "o3").exists()


BAD_CASES = {
    "missing_field": ("bad.jsonl", b'{"text": "fine"}\n{"body": "no text"}\n', "line 2: no field 'text'"),
    "not_utf8_jsonl": ("bad.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "line 2: not valid UTF-8"),
    "not_utf8_txt": ("bad.txt", b"caf\xe9 au lait", "not valid utf-8 text: byte 0xE9"),
    "empty_txt": ("bad.txt", b"  \n", "empty file"),
    "empty_jsonl": ("bad.jsonl", b"", "empty file"),
    "empty_parquet": ("bad.parquet", None, "empty file"),
    "truncated_parquet": ("bad.parquet", "truncate", "not a readable parquet file"),
    "truncated_gzip": ("bad.jsonl.gz", gzip.compress(_jsonl_bytes(_docs("g", 200)))[:-300], "truncated gzip"),
    "truncated_zstd": ("bad.jsonl.zst",
                       zstandard.ZstdCompressor().compress(_jsonl_bytes(_docs("z", 200)))[:-300], "truncated zstd"),
}


def _write_bad(path: Path, content) -> None:
    if content is None:
        pq.write_table(pa.table({"text": pa.array([], pa.string())}), path)
    elif content == "truncate":
        pq.write_table(pa.table({"text": _docs("p", 50)}), path)
        path.write_bytes(path.read_bytes()[:-40])
    else:
        path.write_bytes(content)


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_input_stops_with_one_line_or_is_skipped(tmp_path, capsys, case):
    name, content, message = BAD_CASES[case]
    files = make_corpus(tmp_path / "c", formats=(".jsonl",))
    _write_bad(tmp_path / "c" / name, content)  # sorts before sub0/: a good part may follow it
    (tmp_path / "c" / "a_good.jsonl").write_bytes(_jsonl_bytes(_docs("early", 30)))
    prepare([tmp_path / "c"], tmp_path / "out", expect=1)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {name}") and message in err and "--skip_bad" in err
    # the good file before it kept its part; the failing run wrote no store
    parts = tmp_path / "out.parts" / "parts"
    assert (parts / f"{stream.part_stem('a_good.jsonl')}.json").is_file()
    assert not (tmp_path / "out" / "meta.json").exists()
    meta = prepare([tmp_path / "c"], tmp_path / "out", "--skip_bad")
    assert [s["name"] for s in meta["stream"]["skipped_files"]] == [name]
    assert message.split(": ")[-1] in meta["stream"]["skipped_files"][0]["reason"]
    files["a_good.jsonl"] = _docs("early", 30)
    assert read_split(tmp_path / "out", "train") == expected_splits(files)["train"]


def test_input_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.md").write_text("not an input")
    prepare([tmp_path / "c"], tmp_path / "o", expect=1)
    prepare([tmp_path / "missing"], tmp_path / "o", expect=1)
    (tmp_path / "o_user").mkdir()
    (tmp_path / "o_user" / "thesis.tex").write_text("keep me")
    write_file(tmp_path / "c" / "x.jsonl", _docs("x", 30))
    prepare([tmp_path / "c"], tmp_path / "o_user", expect=1)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3
    assert "holds no .txt" in err[0] and "no such file or folder" in err[1] and "not a token store" in err[2]
    assert (tmp_path / "o_user" / "thesis.tex").read_text() == "keep me"


def test_missing_data_extra_names_the_install(tmp_path, monkeypatch, capsys):
    write_file(tmp_path / "c" / "x.jsonl.zst", _docs("x", 30))
    monkeypatch.setitem(sys.modules, "zstandard", None)
    prepare([tmp_path / "c"], tmp_path / "o", expect=1)
    assert "pip install 'msar-jax[data]'" in capsys.readouterr().err


def test_progress_and_summary(tmp_path, capsys):
    make_corpus(tmp_path / "c", formats=(".jsonl",))
    assert stream.main([str(tmp_path / "c"), f"--out={tmp_path / 'o'}"]) == 0
    out, err = capsys.readouterr()
    assert "tokenising" in err and "M tok/s" in err and "MB/s text" in err
    assert "MB/s text" in out and "M tokens/s" in out and "documents train/val" in out


def test_memory_is_bounded_by_the_batch_not_the_file(tmp_path):
    """A 50 MB jsonl file prepares with a Python heap peak under a quarter of its size (about 2 MiB
    assembly blocks, 1 MiB of chunk tokens and 1 MB text batches, not the file)."""
    rng = np.random.default_rng(0)
    words = np.array([f"word{i}" for i in range(5000)])
    path = tmp_path / "c" / "big.jsonl"
    path.parent.mkdir()
    with open(path, "w") as fh:
        line = 0
        while fh.tell() < 50 << 20:
            text = " ".join(words[rng.integers(0, 5000, size=2000)])
            fh.write(json.dumps({"text": f"{line} {text}"}) + "\n")
            line += 1
    size = path.stat().st_size
    tracemalloc.start()
    try:
        prepare([tmp_path / "c"], tmp_path / "o", "--batch_bytes=1000000")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert sum(s["tokens"] for s in meta["splits"].values()) > 49 << 20
    assert peak < size / 4, (peak, size)
