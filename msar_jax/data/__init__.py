"""Data for the training stack: bundled corpus, ``prepare``, tokenizers, token stores, grain pipeline.

    from msar_jax import data
    meta = data.ensure_prepared()                 # bundled byte-level data in data_cache/

The pipeline names (which import grain and jax) load on first use, so ``python -m
msar_jax.data.prepare`` stays light; the attribute ``data.prepare`` is the function, not the
module. Sources, cache key, split, files and batches: docs/training.md section 6.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

# `python -m msar_jax.data.prepare` imports this package (which imports the
# prepare module for the names below) before running the module as __main__;
# runpy then warns that the module is already in sys.modules. That double
# import is harmless here (the module has no import-time side effects).
warnings.filterwarnings("ignore", category=RuntimeWarning,
                        message=r".*'msar_jax\.data\.prepare' found in sys\.modules.*")

from msar_jax.data.prepare import (
    BUNDLED_PATH,
    SPLIT_RULE,
    BadTextFile,
    DataMismatchError,
    default_cache_dir,
    default_out_dir,
    ensure_prepared,
    is_val_document,
    load_documents,
    prepare,
    provenance,
    read_meta,
    resolve_source,
    source_fingerprint,
)
from msar_jax.data.tokenizers import (
    EOT_TOKEN,
    BPETokenizer,
    ByteTokenizer,
    load_tokenizer,
    tokenizers_available,
)

_PIPELINE_NAMES = (
    "checkpoint_restore_args",
    "checkpoint_save_args",
    "make_eval_batches",
    "make_global_batch",
    "make_train_dataset",
    "make_train_iterator",
    "num_eval_batches",
    "num_windows",
    "open_source",
    "open_tokens",
    "restore_iterator_state",
    "save_iterator_state",
    "segment_ids",
)
_STORE_NAMES = ("TokenStoreWriter", "is_store", "open_split", "write_meta")

__all__ = [
    "BUNDLED_PATH",
    "SPLIT_RULE",
    "EOT_TOKEN",
    "BPETokenizer",
    "BadTextFile",
    "ByteTokenizer",
    "DataMismatchError",
    "default_cache_dir",
    "default_out_dir",
    "ensure_prepared",
    "is_val_document",
    "load_documents",
    "load_tokenizer",
    "prepare",
    "provenance",
    "read_meta",
    "resolve_source",
    "source_fingerprint",
    "tokenizers_available",
    *_PIPELINE_NAMES,
    *_STORE_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _PIPELINE_NAMES:
        return getattr(importlib.import_module("msar_jax.data.pipeline"), name)
    if name in _STORE_NAMES:
        return getattr(importlib.import_module("msar_jax.data.token_store"), name)
    raise AttributeError(f"module 'msar_jax.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PIPELINE_NAMES) | set(_STORE_NAMES))
