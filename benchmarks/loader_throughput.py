"""Tokens per second per host of the training loader: a token store beside a ``.bin`` folder.

    python benchmarks/loader_throughput.py                  # 1 GiB synthetic store in /tmp
    python benchmarks/loader_throughput.py --gib 4 --root /mnt/scratch/loader_bench

Writes a synthetic corpus (uniform uint16 ids, documents of 50..4000 tokens; such ids hardly
compress, so zstd decoding costs less than on real text) once with
``TokenStoreWriter`` and as ``train.bin``, then times ``make_train_iterator`` at the batch shapes
of ``configs/msar.py:size=base`` (64 x 1024) and ``size=paper_28b`` (768 x 8192), as 1 process and
as process 0 of 4 (each process reads only its rows: a host's share). Beside each shape it prints
what training consumes per host: tokens per step / step time / hosts. Results go to
``results/loader_throughput.json``. The store and the folder sit on local disk, warm in the page
cache; a bucket adds request latency, which the read-ahead (``prefetch_buffer_size``) overlaps with
the step. Token stores: docs/training.md §6.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from msar_jax.config import load_config  # noqa: E402
from msar_jax.data import pipeline  # noqa: E402
from msar_jax.data import token_store as tsx  # noqa: E402

BASE_STEP_S = 1.51  # MSAR base, one H100 (BENCHMARKS.md, "Train steps at base")
# paper_28b: an assumption, not a measurement: 6 * 28e9 FLOPs per token on 1024 H100s
# (128 hosts of 8) at 40% of 989 TFLOP/s.
PAPER_HOSTS, PAPER_CHIPS, PAPER_MFU, PAPER_PARAMS = 128, 1024, 0.40, 28e9


def make_corpus(root: Path, gib: float, chunk_tokens: int) -> tuple[Path, Path, dict]:
    store, folder = root / "store", root / "bin"
    n_tokens = int(gib * (1 << 30)) // 2  # uint16
    if tsx.is_store(store) and tsx.read_store_meta(store)["splits"]["train"]["tokens"] == n_tokens \
            and (folder / "train.bin").is_file() and (folder / "train.bin").stat().st_size == 2 * n_tokens:
        return store, folder, {"reused": True}
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    writer = tsx.TokenStoreWriter(store, "train", dtype=np.uint16, chunk_tokens=chunk_tokens)
    t0, done = time.perf_counter(), 0
    with open(folder / "train.bin", "wb") as f:
        while done < n_tokens:
            lengths = rng.integers(50, 4000, size=4096)
            lengths = lengths[np.cumsum(lengths) <= n_tokens - done]
            if lengths.size == 0:
                lengths = np.array([n_tokens - done])
            tokens = rng.integers(0, 50_000, size=int(lengths.sum()), dtype=np.uint16)
            writer.append(tokens, lengths)
            f.write(tokens.tobytes())
            done += tokens.size
    counts = writer.close()
    write_s = time.perf_counter() - t0
    tok = {"kind": "bpe", "vocab_size": 50_000, "eot_id": 0}
    tsx.write_meta(store, {"dtype": "uint16", "tokenizer": tok, "splits": {"train": counts},
                           "source": {"kind": "synthetic", "rule": "uniform ids in [0, 50000)"}})
    (folder / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokenizer": tok}))
    stored = sum(p.stat().st_size for p in (store / "train" / "tokens").rglob("*") if p.is_file())
    return store, folder, {"reused": False, "tokens": n_tokens, "write_s": write_s,
                           "write_tokens_per_s": n_tokens / write_s, "stored_bytes": stored}


def time_loader(path: Path, batch: int, seq_len: int, processes: int, min_s: float, max_batches: int,
                cache_bytes: int) -> dict:
    it = pipeline.make_train_iterator(path, batch_size=batch, seq_len=seq_len, seed=0, process_index=0,
                                      process_count=processes, cache_bytes=cache_bytes)
    next(it)  # opens, fills the read-ahead
    n, t0 = 0, time.perf_counter()
    while n < max_batches and (n < 2 or time.perf_counter() - t0 < min_s):
        rows = next(it)
        n += 1
    dt = time.perf_counter() - t0
    tokens = n * rows.shape[0] * seq_len
    return {"batches": n, "seconds": dt, "tokens_per_s": tokens / dt, "batch_s": dt / n}


def consumption() -> dict:
    base = load_config("configs/msar.py:size=base")
    paper = load_config("configs/msar.py:size=paper_28b")
    base_tokens = base.train.batch_size * base.seq_len
    paper_tokens = paper.train.batch_size * paper.seq_len
    paper_step = 6 * PAPER_PARAMS * paper_tokens / (PAPER_CHIPS * 989e12 * PAPER_MFU)
    return {
        "base": {"batch": base.train.batch_size, "seq_len": base.seq_len, "tokens_per_step": base_tokens,
                 "step_s": BASE_STEP_S, "step_s_source": "measured: MSAR base on one H100 (BENCHMARKS.md)",
                 "hosts": 1, "tokens_per_s_per_host": base_tokens / BASE_STEP_S},
        "paper_28b": {"batch": paper.train.batch_size, "seq_len": paper.seq_len, "tokens_per_step": paper_tokens,
                      "step_s": paper_step,
                      "step_s_source": (f"assumed: 6 * {PAPER_PARAMS / 1e9:.0f}e9 FLOPs per token on {PAPER_CHIPS} H100s "
                                        f"({PAPER_HOSTS} hosts) at {PAPER_MFU:.0%} of 989 TFLOP/s"),
                      "hosts": PAPER_HOSTS, "tokens_per_s_per_host": paper_tokens / paper_step / PAPER_HOSTS},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/msar_loader_bench", help="where the synthetic corpus goes")
    ap.add_argument("--gib", type=float, default=1.0, help="token bytes of the corpus (uint16)")
    ap.add_argument("--chunk_tokens", type=int, default=tsx.DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--cache_mib", type=int, default=tsx.DEFAULT_CACHE_BYTES >> 20)
    ap.add_argument("--min_s", type=float, default=3.0, help="time at least this long per case")
    ap.add_argument("--out", default="results/loader_throughput.json")
    args = ap.parse_args(argv)

    store, folder, corpus = make_corpus(Path(args.root), args.gib, args.chunk_tokens)
    need = consumption()
    rows = []
    for name, c in need.items():
        for processes in (1, 4):
            for kind, path in (("store", store), ("bin", folder)):
                r = time_loader(path, c["batch"], c["seq_len"], processes, args.min_s,
                                max_batches=200, cache_bytes=args.cache_mib << 20)
                rows.append({"config": name, "batch": c["batch"], "seq_len": c["seq_len"], "processes": processes,
                             "loader": kind, **r, "needed_tokens_per_s_per_host": c["tokens_per_s_per_host"]})
    print(f"corpus: {args.gib:g} GiB of uint16 tokens, chunks of {args.chunk_tokens} tokens, "
          f"cache {args.cache_mib} MiB" + (f"; written at {corpus['write_tokens_per_s'] / 1e6:.1f} M tokens/s, "
                                           f"{corpus['stored_bytes'] / 2**30:.2f} GiB stored"
                                           if not corpus.get("reused") else " (reused)"))
    print(f"{'config':<10} {'B x T':>11} {'procs':>5} {'loader':>6} {'batch s':>8} {'tokens/s/host':>14} "
          f"{'needed':>10} {'margin':>7}")
    for r in rows:
        print(f"{r['config']:<10} {r['batch']:>5} x {r['seq_len']:<5} {r['processes']:>5} {r['loader']:>6} "
              f"{r['batch_s']:>8.3f} {r['tokens_per_s']:>14,.0f} {r['needed_tokens_per_s_per_host']:>10,.0f} "
              f"{r['tokens_per_s'] / r['needed_tokens_per_s_per_host']:>6.0f}x")
    for name, c in need.items():
        print(f"{name}: {c['tokens_per_step']:,} tokens/step / {c['step_s']:.2f} s ({c['step_s_source']}) / "
              f"{c['hosts']} host(s) = {c['tokens_per_s_per_host']:,.0f} tokens/s per host")
    out = {"corpus": corpus | {"gib": args.gib, "chunk_tokens": args.chunk_tokens, "cache_mib": args.cache_mib},
           "consumption": need, "rows": rows,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "note": "local disk, page cache warm; one grain thread, prefetch 2"}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
