"""Throughput of ``python -m msar_jax.data.stream`` on a synthetic multi-GB jsonl.zst corpus.

Builds (once, reused while its listing matches) a corpus of ``--shards`` zstd-compressed jsonl
shards holding ``--gib`` GiB of uncompressed jsonl in total, prepares it with the byte tokenizer
over ``--workers`` processes, and reports wall time, MB/s of document text, tokens/s and the peak
RSS (``ru_maxrss`` of this process and of its children: the preparing process and its workers),
with the load average before and after, since other jobs may share the CPUs. The corpus and the
store live under ``--dir`` (default /tmp), never in the repository.

Usage::

    python benchmarks/prepare_throughput.py --gib 2 --workers 2 [--dir /tmp/msar_prepare_bench]

Writes ``results/prepare_throughput.json``. The preparation itself: docs/training.md §6,
"Preparing large corpora".
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent


def build_corpus(root: Path, gib: float, shards: int, seed: int = 0) -> dict:
    """``shards`` files ``shard_00000.jsonl.zst``... of synthetic English-like documents.

    Documents are drawn from a pool of 4096 texts of 200-2000 random words (Zipf-like word
    frequencies, so zstd compresses them about as much as prose, ~3x); each line gets its own id.
    """
    import zstandard

    marker = root / "corpus.json"
    want = {"gib": gib, "shards": shards, "seed": seed}
    if marker.is_file() and json.loads(marker.read_text()).get("spec") == want:
        return json.loads(marker.read_text())
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    vocab = np.array(["".join(chr(97 + c) for c in rng.integers(0, 26, size=rng.integers(2, 10)))
                      for _ in range(20000)])
    p = 1.0 / np.arange(1, vocab.size + 1)
    p /= p.sum()
    pool = []
    for _ in range(4096):
        words = vocab[rng.choice(vocab.size, size=int(rng.integers(200, 2000)), p=p)]
        pool.append(json.dumps(" ".join(words).capitalize() + "."))
    per_shard = int(gib * (1 << 30)) // shards
    cctx = zstandard.ZstdCompressor(level=3)
    n_docs = raw_bytes = 0
    for s in range(shards):
        path = root / f"shard_{s:05d}.jsonl.zst"
        with open(path, "wb") as fh, cctx.stream_writer(fh) as zw:
            written = 0
            picks = rng.integers(0, len(pool), size=per_shard // 1000 + 1)
            i = 0
            while written < per_shard:
                line = f'{{"id": "{s}-{i}", "text": {pool[picks[i % picks.size]]}}}\n'.encode()
                zw.write(line)
                written += len(line)
                i += 1
        n_docs += i
        raw_bytes += written
    info = {"spec": want, "documents": n_docs, "jsonl_bytes": raw_bytes,
            "zst_bytes": sum(p.stat().st_size for p in root.glob("*.zst"))}
    marker.write_text(json.dumps(info))
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="uncompressed jsonl GiB (default 2)")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/msar_prepare_bench")
    ap.add_argument("--out_json", default=str(REPO / "results" / "prepare_throughput.json"))
    args = ap.parse_args()
    base = Path(args.dir)
    t = time.monotonic()
    corpus = build_corpus(base / "corpus", args.gib, args.shards)
    print(f"corpus: {corpus['documents']:,} documents, {corpus['jsonl_bytes'] / 1e9:.2f} GB jsonl, "
          f"{corpus['zst_bytes'] / 1e9:.2f} GB zst ({time.monotonic() - t:.0f} s)", flush=True)
    out = base / "store"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(base / "store.parts", ignore_errors=True)
    cmd = [sys.executable, "-m", "msar_jax.data.stream", str(base / "corpus"), f"--out={out}",
           "--tokenizer=bytes", f"--workers={args.workers}"]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    wall = time.monotonic() - t0
    load_after = os.getloadavg()
    if proc.returncode:
        print(f"error: {' '.join(cmd)} exited with {proc.returncode}", file=sys.stderr)
        return 1
    summary = proc.stdout.strip().splitlines()[-1]
    meta = json.loads((out / "meta.json").read_text())
    tokens = sum(s["tokens"] for s in meta["splits"].values())
    text = sum(meta["stream"]["text_bytes"].values())
    store_bytes = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = {
        "command": " ".join(cmd),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(),
                    "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
                    "loadavg_1_5_15_after": [round(x, 2) for x in load_after]},
        "corpus": {**corpus, "format": ".jsonl.zst"},
        "workers": args.workers,
        "wall_s": round(wall, 2),
        "text_bytes": text,
        "tokens": tokens,
        "text_MB_per_s": round(text / wall / 1e6, 2),
        "jsonl_MB_per_s": round(corpus["jsonl_bytes"] / wall / 1e6, 2),
        "tokens_per_s": round(tokens / wall),
        "cpu_s_children": round(children.ru_utime + children.ru_stime, 1),
        "peak_rss_MiB": {"self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                         "largest_child": round(children.ru_maxrss / 1024, 1)},
        "store_bytes": store_bytes,
        "summary_line": summary,
        "note": ("wall time covers listing, tokenising into parts (workers) and assembling the zarr "
                 "store (one process, zstd level 3); MB = 1e6 bytes of UTF-8 document text"),
    }
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("wall_s", "text_MB_per_s", "tokens_per_s", "peak_rss_MiB",
                                             "cpu_s_children")}))
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}; wrote {args.out_json}")
    shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
