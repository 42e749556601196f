"""Prepared data is what it claims to be: keyed by its source, and made from text only.

* the cache key is the resolved source plus a content fingerprint (``meta.json["source_key"]``):
  same-named folders never share a cache, a changed folder is prepared again, a named folder
  made from something else stops with both sources named, and ``config.json`` records the data
  a run used;
* ``prepare`` rejects (or, asked to, skips and counts) files that are not text in the chosen
  encoding, naming the file and the byte offset, and leaves existing outputs intact.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from msar_jax import data
from msar_jax.config import ConfigError

prep = importlib.import_module("msar_jax.data.prepare")


def _docs(tag: str, n: int = 12) -> dict[str, str]:
    return {f"doc_{i:02d}.txt": f"{tag} document {i}. " + f"The {tag} whale swims on, line {i}. " * 6
            for i in range(n)}


def _write(root: Path, docs: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (root / name).write_text(text, encoding="utf-8")
    return root


def _tokens(out: Path) -> bytes:
    return (out / "train.bin").read_bytes() + (out / "val.bin").read_bytes()


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MSAR_DATA_CACHE", str(root))
    return root


# --------------------------------------------------------------------------- #
# the cache key
# --------------------------------------------------------------------------- #
def test_same_folder_name_different_sources_get_different_data(tmp_path, cache, monkeypatch):
    a = _write(tmp_path / "a" / "corpus", _docs("alpha"))
    b = _write(tmp_path / "b" / "corpus", _docs("beta"))
    meta_a = data.ensure_prepared(source=str(a))
    meta_b = data.ensure_prepared(source=str(b))
    out_a, out_b = data.default_out_dir(str(a)), data.default_out_dir(str(b))
    assert out_a != out_b and out_a.parent == out_b.parent == cache
    assert out_a.name.startswith("corpus-") and out_b.name.startswith("corpus-")
    assert b"alpha" in _tokens(out_a) and b"beta" not in _tokens(out_a)
    assert b"beta" in _tokens(out_b) and b"alpha" not in _tokens(out_b)
    assert meta_a["source_key"]["source"] == str(a.resolve())
    assert meta_b["source_key"]["source"] == str(b.resolve())
    assert meta_a["source_key"]["sha256"] != meta_b["source_key"]["sha256"]
    # the same key when asked again, by a relative path too: reused, nothing rewritten
    stamp = (out_a / "meta.json").stat().st_mtime_ns
    monkeypatch.chdir(tmp_path)
    assert data.ensure_prepared(source="a/corpus") == meta_a
    assert (out_a / "meta.json").stat().st_mtime_ns == stamp


def test_adding_or_changing_a_file_prepares_again(tmp_path, cache):
    src = _write(tmp_path / "corpus", _docs("alpha"))
    first = data.ensure_prepared(source=str(src))
    out = data.default_out_dir(str(src))
    (src / "zz_new.txt").write_text("A newly added zebra document. " * 5, encoding="utf-8")
    second = data.ensure_prepared(source=str(src))
    assert second["documents"]["total"] == first["documents"]["total"] + 1
    assert b"zebra" in _tokens(out)
    # same size, new content (and mtime): the content fingerprint changes
    text = (src / "doc_03.txt").read_text(encoding="utf-8")
    (src / "doc_03.txt").write_text(text.replace("alpha", "omega"), encoding="utf-8")
    third = data.ensure_prepared(source=str(src))
    assert third["source_key"]["sha256"] != second["source_key"]["sha256"] and b"omega" in _tokens(out)
    # only the mtime changes (a copy, a touch): the content decides, the data is kept as it is
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    st = (src / "doc_05.txt").stat()
    os.utime(src / "doc_05.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert data.ensure_prepared(source=str(src))["source_key"]["sha256"] == third["source_key"]["sha256"]
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp


def test_named_folder_made_from_something_else_stops_naming_both(tmp_path):
    a = _write(tmp_path / "a" / "corpus", _docs("alpha"))
    b = _write(tmp_path / "b" / "corpus", _docs("beta"))
    named = tmp_path / "prepared"
    data.prepare(str(a), named)
    before = {p.name: _sha(p) for p in named.iterdir()}
    with pytest.raises(data.DataMismatchError) as e:
        data.ensure_prepared(named, source=str(b))
    msg = str(e.value)
    assert "\n" not in msg and str(a.resolve()) in msg and str(b.resolve()) in msg
    assert f"--source={b}" in msg and f"--out={named}" in msg  # the fix
    with pytest.raises(data.DataMismatchError, match="not from bundled"):
        data.ensure_prepared(named)  # data.source left at its default
    (a / "extra.txt").write_text("one more file", encoding="utf-8")
    with pytest.raises(data.DataMismatchError, match=r"changed since.*13 \.txt files"):
        data.ensure_prepared(named, source=str(a))
    assert {p.name: _sha(p) for p in named.iterdir()} == before  # left alone
    (a / "extra.txt").unlink()
    assert data.ensure_prepared(named, source=str(a))["source_key"]["source"] == str(a.resolve())


def test_train_prepare_data_names_the_config_field(tmp_path):
    from msar_jax.config import load_config
    from msar_jax.train.train import prepare_data

    a = _write(tmp_path / "a" / "corpus", _docs("alpha"))
    b = _write(tmp_path / "b" / "corpus", _docs("beta"))
    data.prepare(str(a), tmp_path / "prepared")
    config = load_config("configs/msar.py:smoke=1", {"data.dir": str(tmp_path / "prepared"),
                                                      "data.source": str(b)})
    with pytest.raises(ConfigError) as e:
        prepare_data(config)
    assert e.value.field == "data.dir" and str(a.resolve()) in str(e.value) and "\n" not in str(e.value)
    (b / "bad.txt").write_bytes(b"caf\xe9")
    config = load_config("configs/msar.py:smoke=1", {"data.dir": str(tmp_path / "fresh"), "data.source": str(b)})
    with pytest.raises(ConfigError) as e:
        prepare_data(config)
    assert e.value.field == "data.source" and "bad.txt" in str(e.value) and "byte offset 3" in str(e.value)
    config = load_config("configs/msar.py:smoke=1", {"data.source": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match=r"'data.source' = '.*missing': not 'bundled', not 'stdlib', and not a dir"):
        prepare_data(config)


def _run_config(src: Path):
    from msar_jax.config import load_config

    return load_config("configs/msar.py:smoke=1,block_size=2", {
        "data.source": str(src), "train.steps": 20, "train.eval_every": 0, "train.eval_batches": 1,
        "train.progress": False, "train.tensorboard": False, "train.depth_weights": False})


def _check_data_used(workdir: Path, src: Path) -> dict:
    used = json.loads((workdir / "config.json").read_text())["data_used"]
    assert used["source"] == str(src.resolve())
    assert used["dir"] == str(data.default_out_dir(str(src)).resolve())
    assert used["fingerprint"] == data.source_fingerprint(str(src))["sha256"]
    assert used["files_sha256"]["train"] == _sha(Path(used["dir"]) / "train.bin")
    return used


class _StopBeforeCompile(Exception):
    pass


def test_config_json_records_the_data_used(tmp_path, cache, monkeypatch):
    """Two runs on same-named folders record different data (the run stops before compiling)."""
    train_mod = importlib.import_module("msar_jax.train.train")

    def stop(*args, **kwargs):
        raise _StopBeforeCompile

    monkeypatch.setattr(train_mod, "compiled_steps", stop)
    runs = {}
    for tag in ("alpha", "beta"):
        src = _write(tmp_path / tag / "corpus", _docs(tag, 20))
        with pytest.raises(_StopBeforeCompile):
            train_mod.train(_run_config(src), tmp_path / f"run_{tag}", max_steps=1)
        runs[tag] = _check_data_used(tmp_path / f"run_{tag}", src)
    assert runs["alpha"]["dir"] != runs["beta"]["dir"]
    assert runs["alpha"]["fingerprint"] != runs["beta"]["fingerprint"]
    # the run's config still loads (introspection reads it back as a ConfigDict)
    from msar_jax.train.introspection import load_run_config
    assert load_run_config(tmp_path / "run_beta").data_used.source == runs["beta"]["source"]


@pytest.mark.slow  # compiles the smoke model: ~40-80 s on a shared 2-core CPU
@pytest.mark.usefixtures("fast_train_compile")
def test_tiny_training_run_records_the_data_used(tmp_path, cache):
    from msar_jax.train import train

    src = _write(tmp_path / "corpus", _docs("alpha", 20))
    result = train(_run_config(src), tmp_path / "run", max_steps=1)
    used = _check_data_used(tmp_path / "run", src)
    assert used["dir"] == str(Path(result["data_dir"]).resolve()) and result["step"] == 1


# --------------------------------------------------------------------------- #
# text only
# --------------------------------------------------------------------------- #
def _random_bytes() -> bytes:
    raw = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    return b"plain start " + raw


ELF = b"\x7fELF\x02\x01\x01\x00" + bytes(8) + b"\x02\x00\x3e\x00" + b"text-ish tail" * 10
BAD_FILES = {
    # name: (bytes, what the one-line error must say)
    "random.txt": (_random_bytes(), r"byte offset \d+"),
    "program.txt": (ELF, "a NUL byte at byte offset 7: a binary file"),
    "latin1.txt": ("Le café est noir.".encode("latin-1"), "not valid utf-8 text: byte 0xE9 at byte offset 6"),
    "utf16.txt": ("Hello, whale.".encode("utf-16"),
                  r"NUL byte at byte offset 3: UTF-16 text \(pass --encoding=utf-16\)"),
    "utf16le.txt": ("Hello, whale.".encode("utf-16-le"), r"offset 1: UTF-16 text"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_file_is_rejected_naming_file_and_offset(tmp_path, name, capsys):
    raw, pattern = BAD_FILES[name]
    src = _write(tmp_path / "src", _docs("alpha"))
    (src / name).write_bytes(raw)
    with pytest.raises(data.BadTextFile, match=pattern) as e:
        data.prepare(str(src), tmp_path / "out")
    assert name in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()  # nothing written
    assert prep.main([f"--source={src}", f"--out={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and str(src / name) in err[0]


def test_failed_prepare_keeps_existing_outputs(tmp_path):
    src = _write(tmp_path / "src", _docs("alpha"))
    out = tmp_path / "out"
    data.prepare(str(src), out)
    before = {p.name: _sha(p) for p in out.iterdir()}
    (src / "program.txt").write_bytes(ELF)
    with pytest.raises(data.BadTextFile):
        data.prepare(str(src), out)
    assert {p.name: _sha(p) for p in out.iterdir()} == before


def test_skip_bad_files_skips_and_counts(tmp_path, capsys):
    src = _write(tmp_path / "src", _docs("alpha"))
    for name in ("program.txt", "latin1.txt", "utf16.txt"):
        (src / name).write_bytes(BAD_FILES[name][0])
    out = tmp_path / "out"
    assert prep.main([f"--source={src}", f"--out={out}", "--skip_bad_files"]) == 0
    out_text = capsys.readouterr().out
    assert "skipped 3 file(s) that are not utf-8 text: latin1.txt, program.txt, utf16.txt" in out_text
    meta = data.read_meta(out)
    assert [f["name"] for f in meta["text"]["skipped_files"]] == ["latin1.txt", "program.txt", "utf16.txt"]
    assert "byte offset 6" in meta["text"]["skipped_files"][0]["reason"]
    assert meta["documents"]["total"] == 12 and meta["text"]["replaced_characters"] == 0
    tokens = _tokens(out)
    assert b"ELF" not in tokens and b"\x00" not in tokens and "\ufffd".encode() not in tokens


def test_encoding_latin1_and_utf16_read_accents(tmp_path, capsys):
    docs = {f"d{i}.txt": f"Le café {i} à Noël, señor; naïve façade. " * 4 for i in range(12)}
    for enc in ("latin-1", "utf-16"):
        src = tmp_path / f"src_{enc}"
        src.mkdir()
        for name, text in docs.items():
            (src / name).write_bytes(text.encode(enc))
        out = tmp_path / f"out_{enc}"
        assert prep.main([f"--source={src}", f"--out={out}", f"--encoding={enc}"]) == 0
        assert "replaced" not in capsys.readouterr().out
        tokens = _tokens(out).decode("utf-8")
        assert "café" in tokens and "Noël" in tokens and "señor" in tokens and "\ufffd" not in tokens
        meta = data.read_meta(out)
        assert meta["text"]["encoding"] == {"latin-1": "iso8859-1", "utf-16": "utf-16"}[enc]
        # a training run's ensure_prepared (no encoding given) reuses it as it was made
        assert data.ensure_prepared(out, source=str(src)) == meta
    assert prep.main([f"--source={src}", "--encoding=klingon"]) == 1
    assert "--encoding='klingon'" in capsys.readouterr().err


def test_errors_replace_counts_replacements(tmp_path, capsys):
    src = _write(tmp_path / "src", _docs("alpha"))
    (src / "mixed.txt").write_bytes(b"ok \xff\xfe text \xe9 end")  # 3 bytes that start no UTF-8 character
    out = tmp_path / "out"
    assert prep.main([f"--source={src}", f"--out={out}", "--errors=replace"]) == 0
    assert "replaced 3 undecodable byte sequence(s) with U+FFFD" in capsys.readouterr().out
    assert data.read_meta(out)["text"]["replaced_characters"] == 3
    assert _tokens(out).count("\ufffd".encode()) == 3


def test_text_options_do_not_apply_to_bundled(tmp_path):
    with pytest.raises(ValueError, match="apply to a folder"):
        data.prepare("bundled", tmp_path / "o", encoding="latin-1")


def test_utf8_bom_is_dropped(tmp_path):
    src = _write(tmp_path / "src", _docs("alpha"))
    (src / "bom.txt").write_bytes(b"\xef\xbb\xbfByte-order-marked text.")
    data.prepare(str(src), tmp_path / "out")
    tokens = _tokens(tmp_path / "out")
    assert b"Byte-order-marked" in tokens and b"\xef\xbb\xbf" not in tokens


def test_crash_while_replacing_outputs_reads_as_unprepared(tmp_path, monkeypatch):
    a = _write(tmp_path / "a", _docs("alpha"))
    out = tmp_path / "out"
    data.prepare(str(a), out)
    (a / "doc_00.txt").write_text("changed " * 40, encoding="utf-8")
    calls, real_replace = [], os.replace

    def crash_on_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(prep.os, "replace", crash_on_second)
    with pytest.raises(OSError, match="disk full"):
        data.prepare(str(a), out)
    monkeypatch.setattr(prep.os, "replace", real_replace)
    assert not (out / "meta.json").exists()  # new train.bin, old val.bin: not a prepared folder
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    meta = data.ensure_prepared(out, source=str(a))  # prepared again, whole
    assert meta["files"]["val.bin"]["sha256"] == _sha(out / "val.bin")
    assert b"changed" in _tokens(out)
