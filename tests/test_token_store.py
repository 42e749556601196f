"""Token stores (msar_jax.data.token_store) and the grain loader over them; document_mask."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from msar_jax import data
from msar_jax.config import ConfigError, REPO_ROOT, load_config
from msar_jax.data import pipeline
from msar_jax.data import token_store as tsx

TOKENIZER = {"kind": "bpe", "vocab_size": 1000, "eot_id": 999}


def _docs(seed: int, n_docs: int, max_len: int, vocab: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=n_docs)
    return rng.integers(0, vocab, size=int(lengths.sum())).astype(dtype), lengths


def _write_store(root, splits: dict, dtype, chunk_tokens=64, appends=7, tokenizer=TOKENIZER,
                 max_in_flight=tsx.MAX_WRITES_IN_FLIGHT):
    """Write ``{split: (tokens, lengths)}`` in ``appends`` uneven pieces of whole documents."""
    counts = {}
    for split, (tokens, lengths) in splits.items():
        w = tsx.TokenStoreWriter(root, split, dtype=dtype, chunk_tokens=chunk_tokens,
                                 max_in_flight=max_in_flight)
        cuts = np.linspace(0, lengths.size, appends + 1).astype(int)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for a, b in zip(cuts[:-1], cuts[1:]):
            w.append(tokens[offsets[a]:offsets[b]], lengths[a:b])
            assert w._tokens.pending_size < chunk_tokens  # never more than one chunk held
            assert w._tokens.written % chunk_tokens == 0  # only full chunks written before close
            assert len(w._tokens.in_flight) <= max_in_flight  # memory: a bounded number of chunks
        counts[split] = w.close()
    tsx.write_meta(root, {"dtype": np.dtype(dtype).name, "tokenizer": tokenizer, "splits": counts})
    return counts


def _starts(lengths):
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


# --------------------------------------------------------------------------- #
# the store
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("dtype,vocab", [(np.uint8, 256), (np.uint16, 50_000), (np.uint32, 200_000)])
def test_round_trip_keeps_tokens_doc_starts_and_dtype(tmp_path, dtype, vocab):
    tokens, lengths = _docs(0, 150, 40, vocab, dtype)
    assert tokens.size % 64  # the last chunk is partial
    counts = _write_store(tmp_path / "s", {"train": (tokens, lengths)}, dtype)
    assert counts == {"train": {"tokens": tokens.size, "documents": lengths.size}}
    split = tsx.open_split(tmp_path / "s", "train")
    assert split.dtype == np.dtype(dtype) and split.num_tokens == tokens.size
    got = split.read(0, split.num_tokens)
    assert got.dtype == np.dtype(dtype) and np.array_equal(got, tokens)
    assert np.array_equal(split.read(tokens.size - 5, tokens.size), tokens[-5:])
    assert np.array_equal(split.doc_starts, _starts(lengths))
    meta = json.loads((tmp_path / "s" / "meta.json").read_text())
    assert meta["format"] == "msar-token-store" and meta["format_version"] == 1
    assert json.loads((tmp_path / "s" / "train" / "tokens" / "zarr.json").read_text())["chunk_grid"][
        "configuration"]["chunk_shape"] == [64]


def test_url_forms(tmp_path):
    tokens, lengths = _docs(1, 30, 20, 1000, np.uint16)
    for root in (f"file://{tmp_path}/via_url", f"memory://store_{uuid.uuid4().hex}"):
        _write_store(root, {"val": (tokens, lengths)}, np.uint16)
        assert tsx.is_store(root)
        split = tsx.open_split(root, "val")
        assert np.array_equal(split.read(0, split.num_tokens), tokens)
    assert tsx.is_store(tmp_path / "via_url")  # the same store by its plain path
    assert tsx.kvstore_spec("gs://bucket/prefix") == {"driver": "gcs", "bucket": "bucket", "path": "prefix/"}


def test_rewriting_a_store_makes_it_incomplete_until_meta(tmp_path):
    tokens, lengths = _docs(2, 20, 20, 1000, np.uint16)
    _write_store(tmp_path, {"train": (tokens, lengths)}, np.uint16)
    assert tsx.is_store(tmp_path)
    tsx.TokenStoreWriter(tmp_path, "train", dtype=np.uint16)
    assert not tsx.is_store(tmp_path)


def _store_files(root) -> dict[str, bytes]:
    root = Path(root)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _synchronous_store(root, split, tokens, lengths, dtype, chunk_tokens):
    """The store as a writer that awaits every step writes it: per full chunk (then the last
    partial one) grow the array to the chunk's end and write the chunk, each awaited."""
    for name, values, dt, chunk in (("tokens", tokens, np.dtype(dtype), chunk_tokens),
                                    ("doc_starts", _starts(lengths), np.dtype(np.int64), tsx.DOC_STARTS_CHUNK)):
        metadata = {"shape": [0], "data_type": dt.name,
                    "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [chunk]}},
                    "codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                               {"name": "zstd", "configuration": {"level": 3, "checksum": False}}],
                    "fill_value": 0}
        arr = tsx.ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{root}/{split}/{name}/"},
                           "metadata": metadata}, create=True).result()
        for lo in range(0, values.size, chunk):
            hi = min(lo + chunk, values.size)
            arr = arr.resize(exclusive_max=[hi], expand_only=True).result()
            arr[lo:hi].write(values[lo:hi].astype(dt)).result()


@pytest.mark.parametrize("n_docs,max_in_flight", [(150, 1), (150, 3), (150, 64), (1, 4), (2000, 2)])
def test_writes_in_flight_give_the_files_of_synchronous_writes(tmp_path, n_docs, max_in_flight):
    """The store's files do not depend on how many chunk writes were in flight: byte for byte
    those of growing the array chunk by chunk and awaiting each write."""
    tokens, lengths = _docs(11, n_docs, 40, 50_000, np.uint16)
    want_root, got_root = tmp_path / "sync", tmp_path / "in_flight"
    _synchronous_store(want_root, "train", tokens, lengths, np.uint16, 64)
    _write_store(got_root, {"train": (tokens, lengths)}, np.uint16, max_in_flight=max_in_flight)
    (got_root / "meta.json").unlink()
    want, got = _store_files(want_root), _store_files(got_root)
    assert sorted(got) == sorted(want) and all(got[k] == want[k] for k in want)
    assert json.loads(want["train/tokens/zarr.json"])["shape"] == [tokens.size]


def test_a_failed_chunk_write_raises_and_leaves_the_store_incomplete(tmp_path):
    tokens, lengths = _docs(12, 400, 40, 1000, np.uint16)
    root = tmp_path / "s"
    w = tsx.TokenStoreWriter(root, "train", dtype=np.uint16, chunk_tokens=64, max_in_flight=4)
    (root / "train" / "tokens" / "c").write_text("a file where the chunk folder goes")  # every chunk write fails
    with pytest.raises(tsx.StoreError, match=f"{root}/train/tokens: writing elements \\[0, 64\\) failed") as err:
        w.append(tokens, lengths)
        w.close()
    assert "\n" not in str(err.value)
    with pytest.raises(tsx.StoreError, match="is closed"):
        w.append(tokens, lengths)
    assert not tsx.is_store(root)
    # the same inside a with block: the error surfaces by the end of it, nothing is left pending
    w = tsx.TokenStoreWriter(root, "train", dtype=np.uint16, chunk_tokens=64, max_in_flight=64)
    (root / "train" / "tokens" / "c").write_text("x")
    with pytest.raises(tsx.StoreError, match="train/tokens: writing elements"):
        with w:
            w.append(tokens[:int(lengths[:50].sum())], lengths[:50])  # a few chunks, all in flight
    assert not w._tokens.in_flight and not tsx.is_store(root)


def test_writer_rejects_bad_input(tmp_path):
    w = tsx.TokenStoreWriter(tmp_path, "train", dtype=np.uint8)
    with pytest.raises(tsx.StoreError, match="sum\\(doc_lengths\\) = 3 != tokens.size = 4"):
        w.append(np.zeros(4, np.uint8), np.array([3]))
    with pytest.raises(tsx.StoreError, match="tokens must be integers in \\[0, 255\\]"):
        w.append(np.array([300]), np.array([1]))
    with pytest.raises(tsx.StoreError, match="dtype must be one of"):
        tsx.TokenStoreWriter(tmp_path, "train", dtype=np.int32)
    with pytest.raises(tsx.StoreError, match="max_in_flight must be a positive integer, got 0"):
        tsx.TokenStoreWriter(tmp_path, "train", dtype=np.uint8, max_in_flight=0)


def test_store_errors_name_the_path(tmp_path):
    tokens, lengths = _docs(3, 10, 10, 1000, np.uint16)
    root = tmp_path / "s"
    _write_store(root, {"train": (tokens, lengths)}, np.uint16)
    (root / "meta.json").unlink()
    with pytest.raises(tsx.StoreError, match=f"{root}/meta.json not found.*incomplete"):
        data.make_train_iterator(root, batch_size=2, seq_len=4)
    _write_store(root, {"train": (tokens, lengths)}, np.uint16)
    with pytest.raises(tsx.StoreError, match=f"{root} has no split 'val'"):
        data.make_eval_batches(root, 2, 4)
    with pytest.raises(ValueError, match=f"token store {root}, split 'train' has {tokens.size} tokens, "
                                         "fewer than seq_len"):
        data.make_train_iterator(root, batch_size=2, seq_len=tokens.size)
    for err in (tsx.StoreError("x"),):
        assert "\n" not in str(err)


# --------------------------------------------------------------------------- #
# conversion of prepared folders
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def bundled_pair(tmp_path_factory):
    src = tmp_path_factory.mktemp("bundled_bytes")
    data.ensure_prepared(src)
    dst = tmp_path_factory.mktemp("store") / "bundled"
    tsx.convert_bin_folder(src, dst, chunk_tokens=1 << 16)
    return src, dst


def test_conversion_gives_the_same_batches(bundled_pair):
    src, dst = bundled_pair
    for split in ("train", "val"):
        assert np.array_equal(tsx.open_split(dst, split).read(0, tsx.open_split(dst, split).num_tokens),
                              np.fromfile(src / f"{split}.bin", np.uint8))
    kw = dict(batch_size=8, seq_len=64, seed=5)
    a, b = data.make_train_iterator(src, **kw), data.make_train_iterator(dst, **kw)
    for _ in range(3):
        assert np.array_equal(next(a), next(b))
    ev_a = list(data.make_eval_batches(src, 8, 64, max_batches=3))
    ev_b = list(data.make_eval_batches(dst, 8, 64, max_batches=3))
    assert all(np.array_equal(x, y) for x, y in zip(ev_a, ev_b)) and len(ev_a) == 3
    # document_mask over the folder and over the store: the same segment ids (same separator rule)
    a = data.make_train_iterator(src, **kw, document_mask=True)
    b = data.make_train_iterator(dst, **kw, document_mask=True)
    x, y = next(a), next(b)
    assert np.array_equal(x["tokens"], y["tokens"]) and np.array_equal(x["segment_ids"], y["segment_ids"])


def test_conversion_doc_starts_follow_the_separator(bundled_pair, tmp_path):
    src, dst = bundled_pair
    split = tsx.open_split(dst, "val")
    toks = split.read(0, split.num_tokens)
    starts = split.doc_starts
    assert starts[0] == 0 and np.all(np.diff(starts) > 0)
    assert all(bytes(toks[s - 2:s]) == b"\n\n" for s in starts[1:])
    assert bytes(toks).count(b"\n\n") == starts.size - 1
    # BPE: documents start after each eot id
    folder = tmp_path / "bpe"
    folder.mkdir()
    train = np.array([5, 6, 9, 7, 9, 8, 8, 8], np.uint16)
    train.tofile(folder / "train.bin")
    train[:4].tofile(folder / "val.bin")
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": {
        "kind": "bpe", "vocab_size": 10, "eot_id": 9, "eot_token": "<|endoftext|>"}}))
    assert subprocess.run([sys.executable, "-m", "msar_jax.data.token_store", "convert", f"--src={folder}",
                           f"--dst={tmp_path / 'bpe_store'}"], cwd=REPO_ROOT, capture_output=True).returncode == 0
    assert tsx.open_split(tmp_path / "bpe_store", "train").doc_starts.tolist() == [0, 3, 5]


def test_convert_cli_error_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "msar_jax.data.token_store", "convert",
                           f"--src={tmp_path / 'nothing'}", f"--dst={tmp_path / 'out'}"],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(tmp_path / "nothing") in proc.stderr


# --------------------------------------------------------------------------- #
# the loader
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader") / "s"
    tokens, lengths = _docs(4, 400, 60, 256, np.uint16)  # ids < the smoke model's vocab
    _write_store(root, {"train": (tokens, lengths), "val": _docs(5, 50, 60, 256, np.uint16)}, np.uint16,
                 chunk_tokens=256, tokenizer={"kind": "bpe", "vocab_size": 256, "eot_id": 255})
    return root, tokens, lengths


def test_store_windows_are_the_tokens(store):
    root, tokens, _ = store
    ds = data.make_train_dataset(root, batch_size=4, seq_len=16, seed=0, num_epochs=1)
    batch = ds[0]
    assert batch.dtype == np.int32 and batch.shape == (4, 17)
    for row in batch:
        start = int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(tokens, 17) == row,
                                          axis=1))[0])
        assert start % 17 == 0


def test_iterator_state_restores_the_next_batch(store, tmp_path):
    root, _, _ = store
    kw = dict(batch_size=4, seq_len=16, seed=3, document_mask=True)
    it = data.make_train_iterator(root, **kw)
    for _ in range(5):
        next(it)
    data.save_iterator_state(it, tmp_path / "state.json")
    want = next(it)
    fresh = data.make_train_iterator(root, **kw)
    data.restore_iterator_state(fresh, tmp_path / "state.json")
    got = next(fresh)
    assert np.array_equal(got["tokens"], want["tokens"])
    assert np.array_equal(got["segment_ids"], want["segment_ids"])


def test_two_processes_read_disjoint_rows_of_the_global_batch(store):
    root, _, _ = store
    kw = dict(batch_size=8, seq_len=16, seed=1)
    whole = data.make_train_iterator(root, **kw, process_index=0, process_count=1)
    parts = [data.make_train_iterator(root, **kw, process_index=p, process_count=2) for p in range(2)]
    for _ in range(3):
        rows = [next(p) for p in parts]
        assert rows[0].shape == (4, 17)
        assert np.array_equal(np.concatenate(rows), next(whole))


def _brute_segment_ids(doc_starts, start, length):
    doc_of = lambda pos: int(np.sum(doc_starts <= pos))  # noqa: E731
    return [doc_of(start + j) - doc_of(start) for j in range(length)]


def test_segment_ids_on_a_hand_built_store(tmp_path):
    # documents of 3, 5, 2, 9, 1, 4 tokens: starts 0, 3, 8, 10, 19, 20 (24 tokens)
    lengths = np.array([3, 5, 2, 9, 1, 4])
    tokens = np.arange(24, dtype=np.uint8)
    _write_store(tmp_path, {"val": (tokens, lengths)}, np.uint8, chunk_tokens=5,
                 tokenizer={"kind": "bytes", "vocab_size": 256, "eot_id": None})
    batches = list(data.make_eval_batches(tmp_path, 1, 7, document_mask=True))  # windows at 0, 7, 14
    assert [b["tokens"][0, 0] for b in batches] == [0, 7, 14]
    assert batches[0]["segment_ids"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 1]]  # doc 2 starts at 8
    assert batches[1]["segment_ids"].tolist() == [[0, 1, 1, 2, 2, 2, 2, 2]]  # 7 is in doc 1
    assert batches[2]["segment_ids"].tolist() == [[0, 0, 0, 0, 0, 1, 2, 2]]  # starts at 19, 20
    assert all(b["segment_ids"].dtype == np.int32 for b in batches)
    starts = tsx.open_split(tmp_path, "val").doc_starts
    for s in range(0, 16):
        assert pipeline.segment_ids(starts, [s], 9)[0].tolist() == _brute_segment_ids(starts, s, 9)


def test_document_mask_off_keeps_plain_arrays(store):
    root, _, _ = store
    assert isinstance(next(data.make_train_iterator(root, batch_size=2, seq_len=8)), np.ndarray)
    assert isinstance(next(data.make_eval_batches(root, 2, 8)), np.ndarray)


def test_document_mask_on_bin_folder_needs_a_tokenizer(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"dtype": "uint8"}))
    np.arange(100, dtype=np.uint8).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match="records no tokenizer"):
        data.make_train_iterator(tmp_path, batch_size=2, seq_len=8, document_mask=True)


# --------------------------------------------------------------------------- #
# training with document_mask
# --------------------------------------------------------------------------- #
def _tiny_config(**overrides):
    return load_config("configs/msar.py:smoke=1,block_size=2", overrides)


def test_train_step_with_segment_ids(fast_train_compile, store):
    from msar_jax.model.transformer import lm_loss
    from msar_jax.train import optim, step

    cfg = _tiny_config()
    model_def, params = step.init_model(cfg.model, 0)
    tx, schedule = optim.make_optimizer(cfg.optim, 10)
    root, _, _ = store
    batch = next(data.make_train_iterator(root, batch_size=4, seq_len=32, seed=0, document_mask=True))
    assert batch["segment_ids"].max() > 0  # some window holds a document start
    fresh = lambda: step.init_state(jax.tree.map(jnp.array, params), tx)  # noqa: E731 - the step donates
    masked = step.make_train_step(model_def, tx, schedule)(fresh(), batch)[1]
    model = model_def.merge(params)
    plain = lm_loss(model, batch["tokens"])[0]
    by_hand = lm_loss(model, batch["tokens"],
                      segment_ids=pipeline.segment_ids(tsx.open_split(root, "train").doc_starts,
                                                       _window_starts(root, batch["tokens"]), 33))[0]
    assert abs(float(masked["loss"]) - float(plain)) > 1e-4
    np.testing.assert_allclose(float(masked["loss"]), float(by_hand), rtol=1e-5)
    np.testing.assert_allclose(float(step.make_eval_step(model_def)(params, batch)), float(by_hand) - float(
        masked["aux_loss"]), rtol=1e-5)


@pytest.mark.slow
def test_grad_accum_carries_segment_ids(fast_train_compile, store):
    from msar_jax.train import optim, step

    cfg = _tiny_config()
    model_def, params = step.init_model(cfg.model, 0)
    tx, schedule = optim.make_optimizer(cfg.optim, 10)
    batch = next(data.make_train_iterator(store[0], batch_size=4, seq_len=32, seed=0, document_mask=True))
    fresh = lambda: step.init_state(jax.tree.map(jnp.array, params), tx)  # noqa: E731 - the step donates
    whole = step.make_train_step(model_def, tx, schedule)(fresh(), batch)[1]
    accum = step.make_train_step(model_def, tx, schedule, grad_accum=2)(fresh(), batch)[1]
    np.testing.assert_allclose(float(accum["loss"]), float(whole["loss"]), rtol=1e-4)
    np.testing.assert_allclose(float(accum["grad_norm"]), float(whole["grad_norm"]), rtol=1e-3)


def _window_starts(root, rows):
    """Recover each row's start in the split (rows are windows at multiples of T+1)."""
    toks = tsx.open_split(root, "train").read(0, tsx.open_split(root, "train").num_tokens)
    n = rows.shape[1]
    views = np.lib.stride_tricks.sliding_window_view(toks, n)[::n]
    return np.array([int(np.flatnonzero(np.all(views == r, axis=1))[0]) * n for r in rows])


def test_train_loop_reads_a_store_with_document_mask(fast_train_compile, store, tmp_path):
    from msar_jax.train import train

    root, _, _ = store
    cfg = _tiny_config(**{"data.dir": str(root), "data.document_mask": True, "train.steps": 2,
                          "train.batch_size": 4, "seq_len": 32, "train.eval_every": 0, "train.eval_batches": 1,
                          "train.progress": False, "train.tensorboard": False, "train.depth_weights": False,
                          "checkpoint.every": 0})
    out = train(cfg, tmp_path / "run", handle_signals=False)
    assert out["step"] == 2 and np.isfinite(out["val_loss"])
    used = json.loads((tmp_path / "run" / "config.json").read_text())["data_used"]
    assert used["store"] == str(root) and used["tokens"]["train"] > 0


def test_document_mask_validation():
    from msar_jax.train import validate

    with pytest.raises(ConfigError, match="data.document_mask"):
        validate(_tiny_config(**{"data.document_mask": 1}))
    cfg = _tiny_config(**{"data.document_mask": True})
    cfg.parallel.pipeline.stages = 2
    with pytest.raises(ConfigError, match="data.document_mask.*parallel.pipeline.stages = 2"):
        validate(cfg)
