"""The pre-norm decoder backbone (SPEC 9)."""
