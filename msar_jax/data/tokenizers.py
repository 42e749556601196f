"""Tokenizers for the prepared token files: raw UTF-8 bytes, or byte-level BPE.

Both have ``kind``, ``vocab_size``, ``eot_id``, ``encode(text)`` and ``decode(ids)``;
``load_tokenizer(data_dir)`` rebuilds the one a folder was prepared with. BPE needs the optional
Hugging Face ``tokenizers`` package, imported only when used. Details: docs/training.md
section 6, "Tokenizers".
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

EOT_TOKEN = "<|endoftext|>"


def _require_tokenizers():
    try:
        import tokenizers  # the HF package (absolute import; this module is msar_jax.data.tokenizers)
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "The BPE tokenizer needs the Hugging Face `tokenizers` package, which is not installed. "
            "Install it with `pip install tokenizers`, or use the byte tokenizer (--tokenizer=bytes)."
        ) from e
    return tokenizers


def tokenizers_available() -> bool:
    try:
        _require_tokenizers()
    except ImportError:
        return False
    return True


def tokenizers_version() -> str | None:
    try:
        return _require_tokenizers().__version__
    except ImportError:
        return None


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, exactly 1 byte per token."""

    kind = "bytes"
    vocab_size = 256
    eot_id = None
    eot_token = None
    bytes_per_token = 1.0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() > 255):
            raise ValueError("byte token ids must be in [0, 255]")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=256)"


class BPETokenizer:
    """Byte-level BPE (GPT-2 style) from HF ``tokenizers``, with an ``<|endoftext|>`` token."""

    kind = "bpe"
    eot_token = EOT_TOKEN

    def __init__(self, tokenizer):
        """Wrap a ``tokenizers.Tokenizer``; use ``train`` or ``from_file`` to make one."""
        self._tok = tokenizer
        self.eot_id = tokenizer.token_to_id(EOT_TOKEN)
        if self.eot_id is None:
            raise ValueError(f"tokenizer has no {EOT_TOKEN!r} token")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 8192, min_frequency: int = 2) -> "BPETokenizer":
        """Train on ``texts`` (pass training documents only). ``vocab_size`` >= 257."""
        if int(vocab_size) < 257:
            raise ValueError(f"BPE vocab_size must be >= 257 (256 bytes + {EOT_TOKEN}), got {vocab_size}")
        tk = _require_tokenizers()
        bpe = tk.ByteLevelBPETokenizer(add_prefix_space=False)
        bpe.train_from_iterator(list(texts), vocab_size=int(vocab_size), min_frequency=min_frequency,
                                show_progress=False, special_tokens=[EOT_TOKEN])
        return cls(tk.Tokenizer.from_str(bpe.to_str()))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "BPETokenizer":
        tk = _require_tokenizers()
        if not Path(path).is_file():
            raise FileNotFoundError(f"BPE tokenizer file not found: {path}")
        return cls(tk.Tokenizer.from_file(str(path)))

    def save(self, path: str | os.PathLike) -> None:
        self._tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text).ids)

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [list(e.ids) for e in self._tok.encode_batch(list(texts))]

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def load_tokenizer(data_dir: str | os.PathLike) -> ByteTokenizer | BPETokenizer:
    """The tokenizer that ``data_dir`` was prepared with (reads its ``meta.json``)."""
    meta_path = Path(data_dir) / "meta.json"
    if not meta_path.is_file():
        raise FileNotFoundError(f"{meta_path} not found; prepare the folder with "
                                f"`python -m msar_jax.data.prepare --out={data_dir}`")
    info = json.loads(meta_path.read_text(encoding="utf-8"))["tokenizer"]
    if info["kind"] == "bytes":
        return ByteTokenizer()
    if info["kind"] == "bpe":
        tok = BPETokenizer.from_file(Path(data_dir) / (info.get("file") or "tokenizer.json"))
        if tok.vocab_size != info["vocab_size"]:
            raise ValueError(f"tokenizer.json has vocab {tok.vocab_size}, meta.json says {info['vocab_size']}")
        return tok
    raise ValueError(f"unknown tokenizer kind {info['kind']!r} in {meta_path}")
