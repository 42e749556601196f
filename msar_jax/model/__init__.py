"""The pre-norm decoder backbone (docs/design.md §9)."""
