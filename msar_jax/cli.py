"""Command-line plumbing: every config or flag error is one line on stderr, never a traceback.

``run_absl_cli`` runs the absl command lines (``msar_jax.train``, ``msar_jax.accounting``): it
loads ``--config`` and checks the names of its ``--config.KEY`` overrides itself before
ml-collections can wrap an error in its tracebacks. ``run_cli`` runs the argparse ones, and
``positive_int`` / ``non_negative_int`` / ``shard`` type their numeric flags. A ``ConfigError``
prints as ``error: ...`` with exit status 1.
"""

from __future__ import annotations

import sys

from msar_jax import config as config_lib
from msar_jax.config import check_field, config_file_path, unlocked_config

def config_error_line(error: BaseException) -> str | None:
    """The one-line message of the ``ConfigError`` in ``error``'s chain (``__cause__`` and
    ``__context__``: ml-collections and absl each wrap an error from ``get_config`` once more),
    the one naming a field if there is one; ``None`` when the chain holds no ``ConfigError``."""
    found, seen = None, set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, config_lib.ConfigError):
            if error.field is not None:
                return " ".join(str(error).split())
            found = found or error
        error = error.__cause__ or error.__context__
    return " ".join(str(found).split()) if found is not None else None


def exit_with_error(message: str, status: int = 1):
    """Print ``error: message`` as one line on stderr and exit with ``status``."""
    print("error: " + " ".join(str(message).split()), file=sys.stderr)
    raise SystemExit(status)


def run_cli(main, *args, **kwargs):
    """``main(*args, **kwargs)``; a ``ConfigError`` from it becomes one line and exit status 1."""
    try:
        return main(*args, **kwargs)
    except config_lib.ConfigError as e:
        exit_with_error(config_error_line(e))


def _config_flag_args(argv, name: str):
    """Where ``--name``'s value is in ``argv`` (index, the text before the value, the value) and
    the ``--name.KEY`` overrides as (key, value text or None), in absl's forms: ``--name=V``,
    ``--name V``, ``--name.K=V``, ``--name.K V``, ``--name.K`` and ``--noname.K`` (booleans)."""
    where, overrides, i = None, [], 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or not arg.startswith("-"):
            i += 1
            if arg == "--":
                break
            continue
        flag, eq, value = arg.lstrip("-").partition("=")
        if flag == name:
            if eq:
                where = (i, arg[: len(arg) - len(value)], value)
            elif i + 1 < len(argv):
                i += 1
                where = (i, "", argv[i])
        elif flag.startswith((name + ".", "no" + name + ".")):
            key = flag.split(".", 1)[1]
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                i += 1
                eq, value = "=", argv[i]
            overrides.append((key, value if eq else None))
        i += 1
    return where, overrides


def check_config_flags(argv, name: str = "config") -> list[str]:
    """Load ``--config`` and check the names of its ``--config.KEY`` overrides before absl parses
    them, so that every error is a ``ConfigError`` naming the field, the value and the rule (absl
    would print ml-collections' chained tracebacks). Returns ``argv``, the config path made
    absolute where it is found under the repository root but not in the current folder."""
    argv = list(argv)
    where, overrides = _config_flag_args(argv, name)
    if where is None:
        return argv  # absl says the flag is required
    index, head, spec = where
    path, sep, arg = spec.partition(":")
    file = config_file_path(path)
    argv[index] = f"{head}{file}{sep}{arg}"
    config = unlocked_config(argv[index][len(head):])
    for key, value in overrides:
        check_field(config, key, value)
    return argv


def absl_flags_parser(argv):
    """``app.run``'s ``flags_parser``: absl's parse, each error as one line and exit status 1
    (absl's own prints "FATAL Flags parsing error", and a config error inside it is wrapped
    twice with its traceback pasted into the message)."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        exit_with_error(config_error_line(e) or str(e))


def run_absl_cli(main, argv=None, config_flag: str = "config"):
    """``app.run(main)`` for a CLI with a ``DEFINE_config_file`` flag: config errors (the file,
    its ``:key=value`` text, an override's name, a rule ``main`` checks) and flag errors are one
    line on stderr with exit status 1; ``main`` is free to raise ``ConfigError``."""
    from absl import app

    argv = sys.argv if argv is None else argv
    try:
        argv = check_config_flags(argv, config_flag)
    except config_lib.ConfigError as e:
        exit_with_error(config_error_line(e))
    app.run(lambda args: run_cli(main, args), argv=argv, flags_parser=absl_flags_parser)


def positive_int(text: str) -> int:
    """argparse ``type=`` for counts that must be >= 1 (one line from argparse otherwise)."""
    return _bounded_int(text, 1)


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for counts that may be 0."""
    return _bounded_int(text, 0)


def _bounded_int(text: str, low: int) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= {low}")
    return value


def shard(text: str) -> tuple[int, int]:
    """argparse ``type=`` for ``--shard=i/n`` (0 <= i < n)."""
    import argparse

    i, sep, n = text.partition("/")
    try:
        i, n = int(i), int(n)
    except ValueError:
        sep = ""
    if not sep or not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"{text!r} must be i/n with 0 <= i < n, e.g. 0/4")
    return i, n
