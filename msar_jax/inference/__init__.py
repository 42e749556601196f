"""Inference on a trained model: prefill and decoding with a cache (``decode``; docs/design.md §10)."""
