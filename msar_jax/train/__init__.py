"""Training stack: ``train(config, workdir) -> result`` and ``python -m msar_jax.train``.

Modules: ``train`` (the loop and CLI), ``step`` (train state, jitted steps), ``optim`` (AdamW,
schedules, weight-decay groups), ``checkpoint`` (orbax), ``metrics`` (JSONL / TensorBoard),
``plots`` (PNG loss curve, Figure-4 heatmaps), ``introspection`` (depth-attention weights).
"""

from msar_jax.train.train import NonFiniteLossError, evaluate, prepare_data, train, validate

__all__ = ["NonFiniteLossError", "evaluate", "prepare_data", "train", "validate"]
